"""Graph surgery on converted ONNX graphs: weights as named inputs, loop invariants hoisted out of Loops."""

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
