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


# ------------------------------------------------- weight-only loop work
# Ops whose result is not a function of their inputs alone: never moved.
_UNHOISTABLE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


class _Values:
    """Numbers for values known before a graph runs; one number for the same op of the same inputs.

    A weight input is known by its name, a constant by its type, dims and
    bytes, a node's output by its op, attributes, inputs and position.
    """

    def __init__(self):
        self._ids, self.of_weights = {}, set()

    def number(self, key, reads_weight=False):
        number = self._ids.setdefault(key, len(self._ids))
        if reads_weight:
            self.of_weights.add(number)
        return number

    def constant(self, tensor_or_attribute):
        value = type(tensor_or_attribute).FromString(tensor_or_attribute.SerializeToString())
        value.name = ""
        return self.number(("const", value.SerializeToString(deterministic=True)))

    def outputs(self, node, known):
        """The numbers of `node`'s outputs when every input's number is in `known`, else None."""
        import onnx

        subgraph = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        if node.op_type in _UNHOISTABLE or any(a.type in subgraph for a in node.attribute):
            return None
        if any(name and name not in known for name in node.input):
            return None
        inputs = tuple(known[name] if name else -1 for name in node.input)
        attributes = tuple(sorted(a.SerializeToString(deterministic=True) for a in node.attribute))
        key = (node.domain, node.op_type, attributes, inputs)
        weight = any(i in self.of_weights for i in inputs)
        return [self.number(key + (i,), weight) for i in range(len(node.output))]


def _constant_numbers(values, graph):
    """``{name: number}`` of `graph`'s initializers and input-less Constant nodes (a tensor value)."""
    import onnx

    out = {init.name: values.constant(init) for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and not node.input:
            value = next((a for a in node.attribute if a.name == "value"), None)
            if value is not None and value.type == onnx.AttributeProto.TENSOR:
                out[node.output[0]] = values.constant(value.t)
    return out


def _hoist_weight_ops(graph):
    """Moves the Loop bodies' work on weights alone in front of the Loop, computed once with the graph's own.

    tf2onnx converts the generate graph's loop body with its own reshape of
    every projection kernel and its own transpose of a tied embedding, and
    the prompt's forward pass, outside the loop, has the same ones.
    onnxruntime folds each into a constant when a session is created: one
    more copy of those weights for each place they are computed (a 1B
    model's tied embedding is 1 GiB). A body node whose inputs are all
    weights (the converted function's weight inputs), constants or results
    of such nodes, and that reads a weight, moves in front of its Loop (the
    body reads the result from the outer scope); where the graph computes
    the same op of the same inputs before the Loop, the body reads that
    result instead. The same values are computed by the same ops. Top-level
    Loops only. Returns the number of body nodes moved or merged.
    """
    values = _Values()
    weight = re.compile(re.escape(WEIGHT_INPUT).replace(r"\{\}", r"\d+") + "$")
    known = {i.name: values.number(("weight", i.name), True) for i in graph.input if weight.match(i.name)}
    known.update({init.name: values.constant(init) for init in graph.initializer})
    holder = {number: name for name, number in known.items()}  # number -> an outer name holding it
    nodes, total = [], 0
    taken = _defined_names(graph)  # a moved value's name must be new to the whole graph (SSA over scopes)
    for node in graph.node:
        if node.op_type == "Loop":
            body = next(a.g for a in node.attribute if a.name == "body")
            hoisted, moved = _hoist_from_body(body, values, known, holder, taken)
            nodes.extend(hoisted)
            total += moved
        elif node.op_type == "Constant":
            numbers = _constant_numbers(values, type(graph)(node=[node]))
            known.update(numbers)
        else:
            numbers = values.outputs(node, known)
            if numbers is not None:
                known.update(zip(node.output, numbers, strict=True))
        for name in node.output:
            if name and name in known:  # an omitted optional output ("") holds nothing a body could read
                holder.setdefault(known[name], name)
        nodes.append(node)
    if total:
        nodes = [type(node).FromString(node.SerializeToString()) for node in nodes]
        del graph.node[:]
        graph.node.extend(nodes)
    return total


def _defined_names(graph):
    """``Counter`` of the value names that `graph` and its subgraphs define (inputs, initializers, node outputs).

    A count: sibling subgraphs may define the same name.
    """
    import collections

    import onnx

    names = collections.Counter([i.name for i in graph.input] + [i.name for i in graph.initializer])
    for node in graph.node:
        names.update(name for name in node.output if name)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                names += _defined_names(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    names += _defined_names(sub)
    return names


def _fresh(name, taken):
    """`name`, or `name` with a suffix, not in `taken` (a ``Counter``); added to `taken`."""
    fresh, i = name, 0
    while taken[fresh]:
        i += 1
        fresh = f"{name}__kla_hoisted{i}"
    taken[fresh] += 1
    return fresh


def _hoist_from_body(body, values, known, holder, taken):
    """`_hoist_weight_ops` for one body: returns the nodes to put before its Loop and how many body nodes left it.

    `taken`: the count of each name's definitions in the graph
    (`_defined_names`); a moved value whose name another scope (a sibling
    Loop's body, the outer graph) also defines gets a new one.
    """
    from onnx import helper

    defined = (
        {i.name for i in body.input} | {o for n in body.node for o in n.output} | {i.name for i in body.initializer}
    )
    own = _defined_names(body)
    constants = _constant_numbers(values, body)
    visible = {name: number for name, number in known.items() if name not in defined}
    visible.update(constants)
    returned = {o.name for o in body.output}
    added, rename, leaving = [], {}, set()
    for position, node in enumerate(body.node):
        numbers = values.outputs(node, visible) if node.op_type != "Constant" else None
        if numbers is None or numbers[0] not in values.of_weights or returned.intersection(node.output):
            continue
        leaving.add(position)
        visible.update(zip(node.output, numbers, strict=True))
        used = [(output, number) for output, number in zip(node.output, numbers, strict=True) if output]
        if all(number in holder for _, number in used):  # computed before the Loop already
            rename.update({output: holder[number] for output, number in used})
            continue
        copy = type(node).FromString(node.SerializeToString())
        for j, name in enumerate(copy.input):
            if name in rename:
                copy.input[j] = rename[name]
            elif name in constants:  # a body constant: read an outer one of the same value
                if constants[name] not in holder:
                    outer = _fresh(f"{name}__kla_outer", taken)
                    added.append(helper.make_node("Constant", [], [outer], value=_constant_tensor(body, name, outer)))
                    holder[constants[name]] = outer
                copy.input[j] = holder[constants[name]]
        for j, output in enumerate(copy.output):
            if output and taken[output] > own[output]:  # defined in another scope too: the moved value is renamed
                copy.output[j] = rename[output] = _fresh(output, taken)
        added.append(copy)
        for output, number in zip(copy.output, numbers, strict=True):
            if output:
                holder.setdefault(number, output)
    if not leaving:
        return [], 0
    kept = [type(node).FromString(node.SerializeToString()) for i, node in enumerate(body.node) if i not in leaving]
    del body.node[:]
    body.node.extend(kept)
    if rename:
        _rename_inputs(body, rename)
    # Body constants only the moved nodes read: onnxruntime warns about each unused initializer at session start.
    _drop_unread_initializers(body, set(constants), _names_read(body))
    return added, len(leaving)


def _constant_tensor(body, name, outer):
    """The value of the body's initializer or Constant `name`, as a tensor named `outer`."""
    for init in body.initializer:
        if init.name == name:
            value = type(init).FromString(init.SerializeToString())
            break
    else:
        node = next(n for n in body.node if n.op_type == "Constant" and n.output[0] == name)
        value = next(a.t for a in node.attribute if a.name == "value")
        value = type(value).FromString(value.SerializeToString())
    value.name = outer
    return value
