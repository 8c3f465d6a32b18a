"""Graph surgery on converted ONNX graphs: weights as named inputs, loop invariants hoisted out of Loops,
int8 activations of integer products made unsigned (the fast onnxruntime kernel)."""

import collections
import re

__all__ = []

# The converted functions' weight inputs, in variable order (`onnx_export._with_weights_as_inputs`).
WEIGHT_INPUT = "kla_weight_{}"


def _rename_inputs(graph, mapping):
    """Renames every use of the names in `mapping`, subgraphs (Loop and If bodies) included."""
    import onnx

    for node in graph.node:
        for j, name in enumerate(node.input):
            if name in mapping:
                node.input[j] = mapping[name]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename_inputs(attribute.g, mapping)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _rename_inputs(sub, mapping)
    for output in graph.output:
        if output.name in mapping:
            output.name = mapping[output.name]


def _names_read(graph):
    """Every value name that a node of `graph` or of its subgraphs reads, and the graph's outputs."""
    import onnx

    names = {output.name for output in graph.output}
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names |= _names_read(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    names |= _names_read(sub)
    return names


def _hoist_loop_invariants(graph):
    """Loop-carried values that the body passes through unchanged become reads of the outer value.

    tf2onnx makes every tensor that a TensorFlow while-loop body captures a
    loop-carried value whose body output is its body input: in the generate
    graph, every weight. onnxruntime copies loop-carried values into the
    Loop's final outputs, so a 1B model's generate graph ran past 19 GB for
    4.6 GB of weights. An ONNX body may read outer-scope values directly:
    each such value leaves the loop-carried list (the Loop's input and
    output, the body's input and output) and the body reads the value the
    Loop was given. Values whose final output is read are kept. Nested
    bodies are rewritten first. Returns the number of values removed.
    """
    import onnx

    removed = 0
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                removed += _hoist_loop_invariants(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    removed += _hoist_loop_invariants(sub)
    read = _names_read(graph)
    for node in graph.node:
        if node.op_type != "Loop":
            continue
        body = next(a.g for a in node.attribute if a.name == "body")
        carried = len(node.input) - 2  # inputs: M, cond, carried...; body inputs: iteration, cond, carried...
        hoisted = {}  # index -> (body input name, outer value name)
        for j in range(carried):
            inner, outer = body.input[2 + j].name, node.input[2 + j]
            final = node.output[j] if j < len(node.output) else ""
            if outer and body.output[1 + j].name == inner and (not final or final not in read):
                hoisted[j] = (inner, outer)
        # A value the body also returns in another slot stays (a body output must be the body's own value).
        returned = {output.name for i, output in enumerate(body.output) if i - 1 not in hoisted}
        hoisted = {j: pair for j, pair in hoisted.items() if pair[0] not in returned}
        if not hoisted:
            continue
        mapping = dict(hoisted.values())
        keep = [j for j in range(carried) if j not in hoisted]
        _rename_inputs(body, mapping)
        inputs = [body.input[0], body.input[1]] + [body.input[2 + j] for j in keep]
        outputs = [body.output[0]] + [body.output[1 + j] for j in keep] + list(body.output[1 + carried :])
        value_info = [v for v in body.value_info if v.name not in mapping]
        for field, kept in ((body.input, inputs), (body.output, outputs), (body.value_info, value_info)):
            kept = [type(item).FromString(item.SerializeToString()) for item in kept]
            del field[:]
            field.extend(kept)
        node_inputs = [node.input[0], node.input[1]] + [node.input[2 + j] for j in keep]
        node_outputs = [node.output[j] for j in keep] + list(node.output[carried:])
        del node.input[:]
        node.input.extend(node_inputs)
        del node.output[:]
        node.output.extend(node_outputs)
        removed += len(mapping)
    return removed


def _weight_inputs(proto):
    """``{graph input name: variable index}`` of the weight inputs left in a converted graph."""
    pattern = re.compile(re.escape(WEIGHT_INPUT).replace(r"\{\}", r"(\d+)") + "$")
    out = {}
    for graph_input in proto.graph.input:
        match = pattern.match(graph_input.name)
        if match:
            out[graph_input.name] = int(match.group(1))
    return out


def _name_weight_inputs(proto, names):
    """Renames the weight inputs to the weights' names; returns the variable indices the graph uses.

    A weight that no node reads (e.g. a dropout layer's seed state in an
    inference graph) leaves the graph's inputs: it would be an initializer
    that onnxruntime warns about, once per weight, at every session start.
    """
    used = _weight_inputs(proto)
    read = _names_read(proto.graph)
    unread = {key for key in used if key not in read}
    if unread:
        kept = [graph_input for graph_input in proto.graph.input if graph_input.name not in unread]
        del proto.graph.input[:]
        proto.graph.input.extend(kept)
        used = {key: i for key, i in used.items() if key not in unread}
    _rename_inputs(proto.graph, {key: names[i] for key, i in used.items()})
    for graph_input in proto.graph.input:
        if graph_input.name in used:
            graph_input.name = names[used[graph_input.name]]
    return sorted(used.values())


# ------------------------------------------------------- int8 products
# Ops that pass their first input's values through unchanged (only the shape moves).
_SHAPE_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Transpose", "Flatten", "Identity"}
# Ops of a clip to the int8 range (`keras.quantizers.abs_max_quantize`: round, then clip).
_CLIP_OPS = {"Max", "Min", "Clip"}
# Ops that read only a tensor's shape: its type may change under them.
_SHAPE_READERS = {"Shape", "Size"}
_FLOAT_TYPES = {"FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE"}


def _constants(graph, outer):
    """``{name: TensorProto}`` of the initializers and Constant nodes of `graph`, over those of `outer`."""
    import onnx

    constants = dict(outer)
    constants.update({init.name: init for init in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.type == onnx.AttributeProto.TENSOR:
                    constants[node.output[0]] = attribute.t
    return constants


def _rounded_float_type(name, producer, constants):
    """The float type (a `TensorProto` data type) of `name` if it is rounded values clipped by constants, else None.

    Walks up Max / Min / Clip nodes to a Round; their constant operands give
    the type (the converted graphs carry no value_info for these tensors).
    """
    import onnx

    dtype = None
    node = producer.get(name)
    while node is not None and node.op_type in _CLIP_OPS:
        for other in node.input[1:]:
            if other in constants and onnx.TensorProto.DataType.Name(constants[other].data_type) in _FLOAT_TYPES:
                dtype = constants[other].data_type
        node = producer.get(node.input[0])
    return dtype if node is not None and node.op_type == "Round" else None


def _is_zero(name, constants):
    from onnx import numpy_helper

    return not name or (name in constants and not numpy_helper.to_array(constants[name]).any())


def _int8_readers(name, readers, outer_read):
    """The MatMulInteger nodes that read the int8 tensor `name` as their ``A`` (through shape-only ops), or None.

    None when any other node (or a subgraph, or the graph's output) reads the
    values: only a product's ``A`` input (or an op that reads only the shape) may change type.
    """
    products, frontier = [], [name]
    while frontier:
        name = frontier.pop()
        if name in outer_read:
            return None
        for node, index in readers[name]:
            if node.op_type in _SHAPE_OPS and index == 0:
                frontier.append(node.output[0])
            elif node.op_type == "MatMulInteger" and index == 0:
                products.append(node)
            elif node.op_type in _SHAPE_READERS:
                continue
            else:
                return None
    return products


def _unsigned_int8_products(graph):
    """Makes the int8 activations of `MatMulInteger` nodes uint8 with zero point 128; returns how many casts changed.

    Keras' int8 layers quantize their inputs to int8 (``round`` then a clip
    to [-127, 127]) and multiply int8 by int8. onnxruntime's CPU kernel for
    int8 x int8 (without AVX-VNNI-INT8) is its portable one, several times
    slower than its float32 product; uint8 x int8 is its fast one (VNNI /
    AVX2). ``x + 128`` of a value in [-127, 127] is exact in any float type
    and in uint8, and ``(x + 128 - 128) * w`` is ``x * w`` in int32: the
    products' results are unchanged, bit for bit. A cast is rewritten only
    where its input is a clipped ``Round`` and every reader of its values
    is a product's ``A`` (with zero point 0 or none), through shape-only
    ops. Subgraphs (Loop and If bodies) are rewritten too, and the zero
    points the products no longer read leave the initializers (onnxruntime
    warns about each unused one at every session start).
    """
    replaced = set()
    changed = _rewrite_int8_products(graph, {}, replaced)
    if replaced:
        _drop_unread_initializers(graph, replaced, _names_read(graph))
    return changed


def _drop_unread_initializers(graph, candidates, read):
    """Removes the initializers named in `candidates` that no node of `graph` or of its subgraphs reads."""
    import onnx

    kept = [init for init in graph.initializer if init.name not in candidates or init.name in read]
    if len(kept) != len(graph.initializer):
        kept = [type(init).FromString(init.SerializeToString()) for init in kept]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    for node in graph.node:
        for attribute in node.attribute:
            subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs
            for sub in subgraphs:
                _drop_unread_initializers(sub, candidates, read)


def _rewrite_int8_products(graph, outer, replaced):
    """`_unsigned_int8_products` on `graph` (outer-scope constants in `outer`); adds the replaced zero points'
    names to `replaced`."""
    import onnx
    from onnx import helper

    constants = _constants(graph, outer)
    changed = 0
    for node in graph.node:
        for attribute in node.attribute:
            subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs
            for sub in subgraphs:
                changed += _rewrite_int8_products(sub, constants, replaced)
    producer = {output: node for node in graph.node for output in node.output}
    readers = collections.defaultdict(list)
    outer_read = {output.name for output in graph.output}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers[name].append((node, index))
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                outer_read |= _names_read(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    outer_read |= _names_read(sub)
    zero_point = f"{graph.name}__kla_u8_zero_point"
    before = {}  # position of a cast -> the nodes to insert before it
    for position, cast in enumerate(graph.node):
        to = next((a.i for a in cast.attribute if a.name == "to"), None)
        if cast.op_type != "Cast" or to != onnx.TensorProto.INT8:
            continue
        dtype = _rounded_float_type(cast.input[0], producer, constants)
        products = _int8_readers(cast.output[0], readers, outer_read) if dtype is not None else None
        if not products or not all(_is_zero(p.input[2] if len(p.input) > 2 else "", constants) for p in products):
            continue
        offset, shifted = f"{cast.output[0]}__kla_u8_offset", f"{cast.output[0]}__kla_u8_shifted"
        before[position] = [
            helper.make_node("Constant", [], [offset], value=helper.make_tensor(offset, dtype, [], [128.0])),
            helper.make_node("Add", [cast.input[0], offset], [shifted]),
        ]
        cast.input[0] = shifted
        for attribute in cast.attribute:
            if attribute.name == "to":
                attribute.i = onnx.TensorProto.UINT8
        for product in products:
            while len(product.input) < 3:
                product.input.append("")
            replaced.add(product.input[2])
            product.input[2] = zero_point
    if before:
        nodes = [
            helper.make_node(
                "Constant", [], [zero_point], value=helper.make_tensor(zero_point, onnx.TensorProto.UINT8, [], [128])
            )
        ]
        for position, node in enumerate(graph.node):
            nodes.extend(before.get(position, []))
            nodes.append(node)
        nodes = [type(node).FromString(node.SerializeToString()) for node in nodes]
        del graph.node[:]
        graph.node.extend(nodes)
    return changed + len(before)
