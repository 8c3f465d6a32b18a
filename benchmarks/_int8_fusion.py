"""The int8 export's integer products rewritten to the pattern of onnxruntime's `MatMulIntegerToFloat` fusion.

An experiment of `benchmarks.bench_int8_onnx`, not applied by `export_onnx`:
measured, the fused kernel decodes no faster than the products it replaces
(docs/dev/history/export.md, "int8 and bfloat16 in onnxruntime").

Keras' int8 layers rescale an integer product by dividing it by the product
of the two scales (``x_scale`` one per token, ``w_scale`` one per output
channel): tf2onnx writes ``MatMulInteger -> Cast(float) -> Div(Mul(x_scale,
w_scale))``. onnxruntime's CPU optimizer fuses ``MatMulInteger -> Cast ->
Mul(Mul(a_scale, b_scale))`` (and a constant bias ``Add`` after it) into one
``com.microsoft.MatMulIntegerToFloat`` kernel that scales the int32 sums as
it writes them. `integer_to_float_products` turns the division into that
multiplication: ``Mul(Cast(P), Mul(1 / x_scale, 1 / w_scale))``. The file
stays standard ONNX (onnxruntime fuses it when it loads the graph).

Numerics: the integer sums are the same. Keras rounds twice after them (the
scales' product, the division); the rewritten graph four times (two
reciprocals, the scales' product and the multiplication; the fused kernel
with one scale per row multiplies by ``1 / w_scale`` and then by
``1 / x_scale``, four roundings too): a relative difference of at most
about 6 float32 epsilons per product output, which the next quantizer can
turn into one grid step (`_verify_bounds.quantized_term`'s model).

A constant bias right after the product is added with ``Sub(y, Neg(bias))``
(``y + bias`` bit for bit): onnxruntime 1.31's fused kernel, given a bias and
a per-row ``a_scale``, multiplies the bias by ``a_scale`` too (wrong for
every batch or prompt of more than one row), so the bias must stay out of the
fused node.
"""

import re

from keras_linattn.export import _onnx_graph

__all__ = ["integer_to_float_products"]

# Ops whose result is not a function of their inputs alone: never a weight-derived value.
_RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


def _subgraphs(node):
    import onnx

    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def _fixed_values(graph, outer):
    """Names of `graph`'s values computed from weights and constants alone (over the set `outer` of the enclosing
    scopes): the converted function's weight inputs, initializers, Constant nodes and the nodes of only those."""
    weight = re.compile(re.escape(_onnx_graph.WEIGHT_INPUT).replace(r"\{\}", r"\d+") + "$")
    fixed = set(outer) | {i.name for i in graph.input if weight.match(i.name)}
    fixed |= {init.name for init in graph.initializer}
    for node in graph.node:
        if node.op_type in _RANDOM or any(True for _ in _subgraphs(node)):
            continue
        if all(not name or name in fixed for name in node.input):
            fixed.update(name for name in node.output if name)
    return fixed


def integer_to_float_products(graph, outer=frozenset(), outer_constants=None, taken=None):
    """Rewrites ``MatMulInteger -> Cast -> Div(Mul(s, t))`` to ``... -> Mul(Mul(1 / s, 1 / t))``; returns how many.

    Only products whose ``A`` is uint8 (`_onnx_graph._unsigned_int8_products`:
    onnxruntime's fused kernel takes a uint8 ``A`` only), whose int32 result
    and its cast are read by nothing else, are rewritten. Subgraphs (Loop
    and If bodies) too.

    Args:
        graph: an ONNX `GraphProto`, changed in place.
        outer: names of weight-derived values of the enclosing scopes.
        outer_constants: the enclosing scopes' constants (`_onnx_graph._constants`).
        taken: the count of each name's definitions in the whole model (`_onnx_graph._defined_names`;
            a new name is new to every scope).

    Returns:
        The number of products rewritten, subgraphs included.
    """
    import onnx

    taken = _onnx_graph._defined_names(graph) if taken is None else taken
    constants = _onnx_graph._constants(graph, outer_constants or {})
    fixed = _fixed_values(graph, outer)
    changed = sum(
        integer_to_float_products(sub, fixed, constants, taken) for node in graph.node for sub in _subgraphs(node)
    )
    producer = {output: node for node in graph.node for output in node.output}
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    pinned = {output.name for output in graph.output}  # values read outside this scope's nodes
    for node in graph.node:
        for sub in _subgraphs(node):
            pinned |= _onnx_graph._names_read(sub)

    def only_reader(name, node):
        return name not in pinned and [id(n) for n in readers.get(name, [])] == [id(node)]

    def uint8_constant(name):
        return name in constants and constants[name].data_type == onnx.TensorProto.UINT8

    before = {}  # id of a node -> the nodes to insert before it
    reciprocals = {}  # scale name -> its reciprocal's name (one per scale and scope)
    removed = set()
    for div in graph.node:
        cast = producer.get(div.input[0]) if div.op_type == "Div" else None
        if cast is None or cast.op_type != "Cast" or not only_reader(cast.output[0], div):
            continue
        if next((a.i for a in cast.attribute if a.name == "to"), None) != onnx.TensorProto.FLOAT:
            continue
        product, scales = producer.get(cast.input[0]), producer.get(div.input[1])
        if product is None or product.op_type != "MatMulInteger" or not only_reader(product.output[0], cast):
            continue
        if len(product.input) < 3 or not uint8_constant(product.input[2]) or scales is None:
            continue
        if scales.op_type != "Mul":
            continue
        inserted = []
        inverse = []
        for scale in scales.input:
            if scale not in reciprocals:
                reciprocals[scale] = _onnx_graph._fresh(f"{scale}__kla_reciprocal", taken)
                inserted.append(onnx.helper.make_node("Reciprocal", [scale], [reciprocals[scale]]))
            inverse.append(reciprocals[scale])
        multiplier = _onnx_graph._fresh(f"{div.output[0]}__kla_multiplier", taken)
        inserted.append(onnx.helper.make_node("Mul", inverse, [multiplier]))
        before[id(div)] = inserted
        if only_reader(scales.output[0], div):
            removed.add(id(scales))
        div.op_type = "Mul"
        div.input[1] = multiplier
        changed += 1
        bias_add = _bias_add(div, readers, pinned, fixed)
        if bias_add is not None:
            negated = _onnx_graph._fresh(f"{bias_add.output[0]}__kla_negated_bias", taken)
            bias = bias_add.input[1] if bias_add.input[0] == div.output[0] else bias_add.input[0]
            before.setdefault(id(bias_add), []).append(onnx.helper.make_node("Neg", [bias], [negated]))
            bias_add.op_type = "Sub"
            bias_add.input[0], bias_add.input[1] = div.output[0], negated
    if before or removed:
        nodes = []
        for node in graph.node:
            nodes.extend(before.get(id(node), []))
            if id(node) not in removed:
                nodes.append(node)
        nodes = [type(node).FromString(node.SerializeToString()) for node in nodes]
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _bias_add(product, readers, pinned, fixed):
    """The ``Add`` of a weight-derived value that is the only reader of `product`'s output, or None."""
    name = product.output[0]
    users = readers.get(name, [])
    if name in pinned or len(users) != 1 or users[0].op_type != "Add" or list(users[0].input).count(name) != 1:
        return None
    other = next(n for n in users[0].input if n != name)
    return users[0] if other in fixed else None
