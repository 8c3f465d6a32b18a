"""Exports of quantized and bfloat16 models: the files carry the small weights, onnxruntime multiplies in int8,
and `verify` passes with the quantization error model's bound (`_verify_bounds.quantized_term`)."""

import collections
import os
import random

import keras
import numpy as np
import onnx
import pytest

from keras_linattn import export
from keras_linattn.models import LinearBackbone, LinearCausalLM

pytestmark = pytest.mark.numeric

# The exports take a minute or more on 2 loaded cores: every test here is `slow` (`make test-slow`).

# Ops that multiply an int8 weight as integers; any of them is an int8 product in onnxruntime.
INTEGER_PRODUCTS = {"MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul", "MatMulIntegerToFloat"}


def _lm(width, vocabulary, dtype=None, mode=None):
    keras.utils.set_random_seed(0)
    np.random.seed(0)
    random.seed(0)
    backbone = LinearBackbone(
        vocabulary_size=vocabulary,
        num_layers=2,
        hidden_dim=width,
        num_heads=4,
        intermediate_dim=4 * width,
        dtype=dtype,
    )
    lm = LinearCausalLM(backbone=backbone, preprocessor=None)
    if mode is not None:
        lm.quantize(mode)
    return lm


def _size(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _export(lm, base):
    version_dir = export.export_saved_model(lm, os.path.join(base, "sm"), warmup=False)
    paths = export.export_onnx(lm, os.path.join(base, "lm.onnx"))
    return version_dir, paths


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory):
    lm = _lm(32, 48, mode="int8")
    return lm, *_export(lm, str(tmp_path_factory.mktemp("int8")))


def _int8_initializer_consumers(path):
    """Op types of the nodes that read each int8 initializer, through Reshape / Transpose / Identity."""
    graph = onnx.load(path).graph
    readers = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    consumers = {}
    for init in graph.initializer:
        if init.data_type != onnx.TensorProto.INT8 or len(init.dims) < 2:  # zero points are scalars
            continue
        found, frontier = set(), [init.name]
        while frontier:
            for node in readers[frontier.pop()]:
                if node.op_type in ("Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze"):
                    frontier.extend(node.output)
                else:
                    found.add(node.op_type)
        consumers[init.name] = found
    return consumers


@pytest.mark.slow
def test_onnx_multiplies_every_int8_kernel_as_integers(int8_export):
    lm, _, paths = int8_export
    for kind in ("model", "step"):
        consumers = _int8_initializer_consumers(paths[kind])
        # q, k, v, o and two feed-forwards per block, and the tied embedding.
        assert len(consumers) == 6 * 2 + 1, (kind, consumers)
        for name, ops in consumers.items():
            if "embedding" in name:
                # A lookup (Gather, then a cast of the rows read) and the tied output projection.
                assert ops & INTEGER_PRODUCTS and ops <= INTEGER_PRODUCTS | {"Gather"}, (kind, name, ops)
            else:
                assert ops and ops <= INTEGER_PRODUCTS, (kind, name, ops)
        types = {node.op_type for node in onnx.load(paths[kind]).graph.node}
        assert "DequantizeLinear" not in types


def _integer_products(graph, outer=None):
    """``(op type, zero point of A)`` of every integer product of `graph` and its subgraphs (Loop bodies)."""
    constants = dict(outer or {})
    constants.update({t.name: t for t in graph.initializer})
    constants.update({n.output[0]: a.t for n in graph.node if n.op_type == "Constant" for a in n.attribute})
    found = []
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                found += _integer_products(attribute.g, constants)
        if node.op_type in INTEGER_PRODUCTS:
            zero_point = node.input[2] if len(node.input) > 2 else ""
            found.append((node.op_type, constants[zero_point].data_type if zero_point in constants else None))
    return found


@pytest.mark.slow
def test_onnxruntime_runs_uint8_by_int8_products(int8_export, tmp_path):
    """In the graphs onnxruntime runs (after its optimizations), every integer product takes a uint8 A:
    its int8 x int8 CPU kernel is the portable one, slower than float32 (`_onnx_graph._unsigned_int8_products`)."""
    import onnxruntime as ort

    _, _, paths = int8_export
    for kind in ("model", "step", "generate"):
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / f"{kind}_optimized.onnx")
        ort.InferenceSession(paths[kind], options, providers=["CPUExecutionProvider"])
        products = _integer_products(onnx.load(options.optimized_model_filepath).graph)
        assert len(products) >= 6 * 2 + 1, (kind, products)  # q, k, v, o, two feed-forwards a block; the head
        assert {zero_point for _, zero_point in products} == {onnx.TensorProto.UINT8}, (kind, products)


@pytest.mark.slow
def test_generator_keeps_int8_weights_repacked(int8_export):
    """Without its repacked weights, onnxruntime's integer product repacks each weight at every call (several
    times slower decode): an int8 export's `OnnxGenerator` keeps the repacked copies, int8-sized, by default."""
    from keras_linattn.export import OnnxGenerator, _onnx_files

    lm, _, paths = int8_export
    int8_bytes = sum(int(np.prod(w.shape)) for w in lm.weights if str(w.dtype) == "int8")
    assert _onnx_files.read_metadata(paths["step"])["int8_weight_bytes"] == int8_bytes > 0
    generator = OnnxGenerator(paths["step"], device="cpu")
    generator.generate(np.array([[1, 2, 3]], "int32"), max_length=5)
    for predictor in (generator.predictor, generator._generate_graph()):
        assert predictor.prepacking is True
        with pytest.raises(RuntimeError):  # onnxruntime: no such entry (prepacking is on unless it is "1")
            predictor.session.get_session_options().get_session_config_entry("session.disable_prepacking")
    assert OnnxGenerator(paths["step"], device="cpu", prepacking=False).predictor.prepacking is False


@pytest.mark.slow
def test_int8_exports_pass_verify(int8_export):
    lm, version_dir, paths = int8_export
    report = export.verify(lm, saved_model_dir=version_dir, onnx_path=paths["model"], decode_steps=3)
    assert report.ok
    # The bound is the quantization error model's: above the float one.
    float_only = [r for r in report.rows if not r.exact and r.tolerance < 1e-3]
    assert not float_only


@pytest.mark.slow
def test_quantized_and_bfloat16_files_carry_the_small_weights(tmp_path):
    sizes = {}
    for name, dtype, mode in (("float32", None, None), ("int8", None, "int8"), ("bfloat16", "bfloat16", None)):
        lm = _lm(256, 1024, dtype=dtype, mode=mode)
        base = str(tmp_path / name)
        version_dir = export.export_saved_model(lm, os.path.join(base, "sm"), warmup=False)
        sizes[name] = {"saved_model": _size(os.path.join(version_dir, "variables"))}
        paths = export.export_onnx(lm, os.path.join(base, "lm.onnx"))
        sizes[name]["onnx"] = sum(_size(p) for p in paths.values())
    assert sizes["int8"]["saved_model"] < 0.35 * sizes["float32"]["saved_model"], sizes
    assert sizes["int8"]["onnx"] < 0.35 * sizes["float32"]["onnx"], sizes
    assert sizes["bfloat16"]["saved_model"] < 0.6 * sizes["float32"]["saved_model"], sizes
    assert sizes["bfloat16"]["onnx"] < 0.6 * sizes["float32"]["onnx"], sizes
