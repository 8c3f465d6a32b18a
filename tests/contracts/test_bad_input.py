"""Bad input at every public entry point gets a ValueError/TypeError that says what was wrong.

One table row per (entry point, bad input): the exception type and fragments
that its message must contain — the argument's name and the value (or shape,
dtype) received. docs/dev/hardening.md has the same table in prose.

Objects the rows need (small layers, a tiny LM, corrupt export files) are
built once per module by the fixtures below.
"""

import json
import os
from functools import cached_property

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_linattn import callbacks, distill, export, feature_maps, samplers
from keras_linattn import ops as la
from keras_linattn.cli import main as cli_main
from keras_linattn.feature_maps import (
    AOGLUFeatureMap,
    FavorPlusFeatureMap,
    FavorTrigFeatureMap,
    FFNFeatureMap,
    GLUFeatureMap,
    HedgehogFeatureMap,
    OGLUFeatureMap,
    ReluFeatureMap,
    TaylorFeatureMap,
)
from keras_linattn.layers import (
    EfficientAttention,
    LinearAttention,
    LinearAttentionCell,
    LinearTransformerDecoder,
    LinearTransformerEncoder,
)
from keras_linattn.models import LinearCausalLM
from keras_linattn.ops.core import _check_state, _zero_state
from keras_linattn.regularizers import OrthogonalRegularizer
from tests import _shared_exports

F = np.float32


def z(*shape):
    return np.zeros(shape, F)


def o(*shape):
    return np.ones(shape, F)


# ------------------------------------------------------------- fixtures
def _built(layer, *input_shapes):
    """``layer`` built on ``input_shapes``."""
    layer.build(*input_shapes)
    return layer


# Plain linear attention (the seed map, no convolution): the expected messages below name its state shapes.
PLAIN = {"feature_map": "elu", "conv_size": None}


class Env:
    """Lazily built objects shared by the rows (built once per module, on first use)."""

    def __init__(self, tmp):
        self.tmp = tmp

    def path(self, name):
        return os.path.join(self.tmp, name)

    def _file(self, name, data):
        """Writes the bytes ``data`` to ``name`` under the temporary folder (making
        the folders on the way) and returns its path."""
        p = self.path(name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
        return p

    def _dir(self, name):
        """Makes the folder ``name`` under the temporary folder and returns its path."""
        d = self.path(name)
        os.makedirs(d, exist_ok=True)
        return d

    # The models below: elu, no convolution. The expected messages name their (S, z) state shapes.
    @cached_property
    def attention(self):
        return _built(LinearAttention(num_heads=2, key_dim=4, **PLAIN), (None, None, 8), (None, None, 8))

    @cached_property
    def lm(self):
        return LinearCausalLM(
            vocabulary_size=16, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16, chunk_size=4, **PLAIN
        )

    @cached_property
    def lm_positions(self):
        return LinearCausalLM(
            vocabulary_size=16,
            num_layers=1,
            hidden_dim=8,
            num_heads=2,
            intermediate_dim=16,
            max_sequence_length=6,
            **PLAIN,
        )

    @cached_property
    def encoder(self):
        return _built(LinearTransformerEncoder(num_heads=2, intermediate_dim=16, **PLAIN), (None, None, 8))

    @cached_property
    def decoder(self):
        return _built(LinearTransformerDecoder(num_heads=2, intermediate_dim=16, **PLAIN), (None, None, 8))

    @cached_property
    def functional(self):
        inp = keras.Input((None, 8), name="features")
        out = LinearAttention(2, 4, **PLAIN)(inp, inp)
        return keras.Model(inp, out)

    @cached_property
    def built_favor(self):
        return _built(FavorPlusFeatureMap(num_features=4, seed=0), (None, None, 2, 4))

    @cached_property
    def corrupt_onnx(self):
        return self._file("corrupt.onnx", b"this is not a protobuf \x00\xff" * 10)

    @cached_property
    def empty_onnx(self):
        return self._file("empty.onnx", b"")

    @cached_property
    def identity_onnx(self):
        """A valid ONNX graph of another model: x [B, 3] float -> y."""
        from onnx import TensorProto, helper, save

        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3])
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", [x], [y])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        p = self.path("identity.onnx")
        save(model, p)
        return p

    @cached_property
    def predictor(self):
        return export.OnnxPredictor(self.identity_onnx, device="cpu")

    @cached_property
    def corrupt_saved_model(self):
        return os.path.dirname(self._file(os.path.join("corrupt_sm", "saved_model.pb"), b"\x00\x01garbage" * 20))

    @cached_property
    def empty_dir(self):
        return self._dir("empty_dir")

    @cached_property
    def other_saved_model(self):
        """A valid SavedModel of another model: serving_default(x [None, 3])."""

        class Other(tf.Module):
            @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
            def serve(self, x):
                return {"y": x * 2.0}

        m = Other()
        d = self.path("other_sm")
        tf.saved_model.save(m, d, signatures={"serving_default": m.serve})
        return d

    @cached_property
    def runner(self):
        return export.SavedModelRunner(self.other_saved_model)

    @cached_property
    def damaged_saved_model(self):
        """A SavedModel version of `functional` whose variables file was truncated after export."""
        version_dir = export.export_saved_model(self.functional, self.path("damaged_sm"), warmup=False)
        data = os.path.join(version_dir, "variables", "variables.data-00000-of-00001")
        with open(data, "r+b") as f:
            f.truncate(10)
        return version_dir

    @cached_property
    def corrupt_keras(self):
        return self._file("corrupt.keras", b"PK\x03\x04 not really a zip")

    @cached_property
    def existing_version_base(self):
        return os.path.dirname(self._dir(os.path.join("versions", "1")))

    @cached_property
    def lm_step_onnx(self):
        """The step graph of the limited LM's ONNX export (`tests._shared_exports.limited_export`, built once
        per run and read only here): the generator's input checks need any LM's step graph, not one more export."""
        _, _, paths = _shared_exports.limited_export()
        return paths["step"]

    @cached_property
    def generator(self):
        return export.OnnxGenerator(self.lm_step_onnx, device="cpu")

    @cached_property
    def not_prediction_logs(self):
        """A valid TFRecord file whose records are not PredictionLog protos."""
        p = self.path("records.tfrecord")
        with tf.io.TFRecordWriter(p) as writer:
            writer.write(b"\xff\xfe not a proto")
        return p

    @cached_property
    def a_file(self):
        return self._file("a_file.txt", b"x")


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Overrides the conftest fixture: no `clear_session()` per row (a full garbage collection,
    hundreds of times in this module); a row builds nothing global that the next
    could trip over, and the policy is still reset."""
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return Env(str(tmp_path_factory.mktemp("bad_input")))


def _cli(env, argv):
    """Runs the CLI; returns (exit code, stderr text) — SystemExit counts as a code."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = cli_main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


# ------------------------------------------------------------------ table
# (id, thunk(env), exception, fragments the message must contain)
V = ValueError
T = TypeError
ROWS = [
    # --- keras_linattn.ops.linear_attention
    (
        "ops.linear_attention/q_features rank 3",
        lambda e: la.linear_attention(z(1, 4, 4), o(1, 4, 1, 4), o(1, 4, 1, 2)),
        V,
        ["q_features", "rank 4", "(1, 4, 4)"],
    ),
    (
        "ops.linear_attention/feature dim mismatch",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 5), o(1, 4, 1, 2)),
        V,
        ["k_features.shape=(1, 4, 1, 5)"],
    ),
    (
        "ops.linear_attention/heads mismatch",
        lambda e: la.linear_attention(o(1, 4, 2, 4), o(1, 4, 2, 4), o(1, 4, 3, 2)),
        V,
        ["`v`", "v.shape=(1, 4, 3, 2)"],
    ),
    (
        "ops.linear_attention/key-value length mismatch",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 5, 1, 2)),
        V,
        ["v.shape=(1, 5, 1, 2)"],
    ),
    (
        "ops.linear_attention/key_mask rank 3",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), key_mask=o(1, 4, 1)),
        V,
        ["key_mask", "(1, 4, 1)"],
    ),
    (
        "ops.linear_attention/key_mask length",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), key_mask=o(1, 5)),
        V,
        ["key_mask.shape=(1, 5)"],
    ),
    (
        "ops.linear_attention/chunk_size=0",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), causal=True, chunk_size=0),
        V,
        ["chunk_size=0"],
    ),
    (
        "ops.linear_attention/chunk_size=-3",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), causal=True, chunk_size=-3),
        V,
        ["chunk_size=-3"],
    ),
    (
        "ops.linear_attention/chunk_size=2.5",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), causal=True, chunk_size=2.5),
        V,
        ["chunk_size=2.5"],
    ),
    (
        "ops.linear_attention/causal with S != T",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 6, 1, 4), o(1, 6, 1, 2), causal=True),
        V,
        ["S == T", "4 queries and 6 keys"],
    ),
    (
        "ops.linear_attention/initial_state S shape",
        lambda e: la.linear_attention(
            o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), initial_state=(z(1, 1, 4, 3), z(1, 1, 4))
        ),
        V,
        ["`initial_state` S", "[B, 1, 4, 2]", "initial_state[0].shape=(1, 1, 4, 3)"],
    ),
    (
        "ops.linear_attention/initial_state not a pair",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), initial_state=z(1, 1, 4, 2)),
        V,
        ["pair (S, z)", "Received: initial_state="],
    ),
    (
        "ops.linear_attention/eps=-1",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), eps=-1.0),
        V,
        ["eps=-1.0"],
    ),
    (
        "ops.linear_attention/eps=nan",
        lambda e: la.linear_attention(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 1, 2), eps=float("nan")),
        V,
        ["eps=nan"],
    ),
    # --- linear_attention_step, and the private state helpers of ops.core
    (
        "ops.linear_attention_step/q_t rank 4",
        lambda e: la.linear_attention_step(o(1, 1, 1, 4), o(1, 1, 4), o(1, 1, 2), _zero_state(1, 1, 4, 2)),
        V,
        ["q_t", "(1, 1, 1, 4)"],
    ),
    (
        "ops.linear_attention_step/state z shape",
        lambda e: la.linear_attention_step(o(1, 1, 4), o(1, 1, 4), o(1, 1, 2), (z(1, 1, 4, 2), z(1, 1, 5))),
        V,
        ["state", "(1, 1, 5)"],
    ),
    (
        "ops.linear_attention_step/state=None",
        lambda e: la.linear_attention_step(o(1, 1, 4), o(1, 1, 4), o(1, 1, 2), None),
        V,
        ["state=None"],
    ),
    (
        "ops.linear_attention_step/eps=-1",
        lambda e: la.linear_attention_step(o(1, 1, 4), o(1, 1, 4), o(1, 1, 2), _zero_state(1, 1, 4, 2), eps=-1.0),
        V,
        ["eps=-1.0"],
    ),
    (
        "ops.core._check_state/batch mismatch",
        lambda e: _check_state((z(2, 1, 4, 2), z(3, 1, 4)), 1, 4, 2),
        V,
        ["S.shape=(2, 1, 4, 2)", "z.shape=(3, 1, 4)"],
    ),
    ("ops.core._zero_state/batch_size=-1", lambda e: _zero_state(-1, 1, 4, 2), V, ["batch_size=-1"]),
    ("ops.core._zero_state/num_heads=0", lambda e: _zero_state(1, 0, 4, 2), V, ["num_heads=0"]),
    (
        "ops.kernel_attention_reference/v rank 3",
        lambda e: la.kernel_attention_reference(o(1, 4, 1, 4), o(1, 4, 1, 4), o(1, 4, 2)),
        V,
        ["`v`", "v.shape=(1, 4, 2)"],
    ),
    (
        "ops.kernel_attention_reference/causal S != T",
        lambda e: la.kernel_attention_reference(o(1, 4, 1, 4), o(1, 6, 1, 4), o(1, 6, 1, 2), causal=True),
        V,
        ["causal=True", "q_features.shape[1]=4", "k_features.shape[1]=6"],
    ),
    (
        "ops.kernel_attention_weights/feature dim mismatch",
        lambda e: la.kernel_attention_weights(o(1, 4, 1, 4), o(1, 4, 1, 5)),
        V,
        ["k_features.shape=(1, 4, 1, 5)"],
    ),
    (
        "ops.kernel_attention_weights/key_mask length",
        lambda e: la.kernel_attention_weights(o(1, 4, 1, 4), o(1, 4, 1, 4), key_mask=o(1, 5)),
        V,
        ["key_mask.shape=(1, 5)"],
    ),
    (
        "ops.softmax_attention/heads mismatch",
        lambda e: la.softmax_attention(o(1, 4, 2, 4), o(1, 4, 2, 4), o(1, 4, 3, 2)),
        V,
        ["`v`", "v.shape=(1, 4, 3, 2)"],
    ),
    (
        "ops.softmax_attention_weights/k rank 3",
        lambda e: la.softmax_attention_weights(o(1, 4, 1, 4), o(1, 4, 4)),
        V,
        ["`k`", "k.shape=(1, 4, 4)"],
    ),
    (
        "ops.softmax_attention_weights/scale='x'",
        lambda e: la.softmax_attention_weights(o(1, 4, 1, 4), o(1, 4, 1, 4), scale="x"),
        V,
        ["scale='x'"],
    ),
    # --- feature map registry
    (
        "feature_maps.get/unknown name",
        lambda e: feature_maps.get("softmax_plus"),
        V,
        ["feature_map='softmax_plus'", "Available"],
    ),
    ("feature_maps.get/wrong type", lambda e: feature_maps.get(42), V, ["feature_map=42"]),
    (
        "feature_maps.get/instance with kwargs",
        lambda e: feature_maps.get(feature_maps.get("elu"), epsilon=1.0),
        V,
        ["kwargs={'epsilon': 1.0}"],
    ),
    (
        "feature_maps.deserialize/unknown class",
        lambda e: feature_maps.deserialize({"class_name": "Nope", "config": {}}),
        V,
        ["class_name='Nope'"],
    ),
    ("feature_maps.deserialize/not a dict", lambda e: feature_maps.deserialize("elu"), V, ["class_name=None"]),
    (
        "feature_maps.register/not a FeatureMap",
        lambda e: feature_maps.register("not_a_map")(int),
        T,
        ["int", "FeatureMap"],
    ),
    (
        "feature_maps.register/name taken",
        lambda e: feature_maps.register("elu")(type("OtherElu", (feature_maps.FeatureMap,), {})),
        V,
        ["'elu'", "already registered"],
    ),
    # --- feature map constructors and calls
    ("ReluFeatureMap/epsilon=-1", lambda e: ReluFeatureMap(epsilon=-1), V, ["epsilon=-1"]),
    ("TaylorFeatureMap/scale=0", lambda e: TaylorFeatureMap(scale=0), V, ["scale=0"]),
    ("FavorPlusFeatureMap/num_features=0", lambda e: FavorPlusFeatureMap(num_features=0), V, ["num_features=0"]),
    ("FavorPlusFeatureMap/kind", lambda e: FavorPlusFeatureMap(kind="gaussian"), V, ["kind='gaussian'"]),
    ("FavorPlusFeatureMap/scaling", lambda e: FavorPlusFeatureMap(scaling="unit"), V, ["scaling='unit'"]),
    ("FavorPlusFeatureMap/seed=-1", lambda e: FavorPlusFeatureMap(seed=-1), V, ["seed=-1"]),
    ("FavorPlusFeatureMap/scale=-1", lambda e: FavorPlusFeatureMap(scale=-1.0), V, ["scale=-1.0"]),
    ("FavorTrigFeatureMap/num_features=-2", lambda e: FavorTrigFeatureMap(num_features=-2), V, ["num_features=-2"]),
    ("HedgehogFeatureMap/feature_size=0", lambda e: HedgehogFeatureMap(feature_size=0), V, ["feature_size=0"]),
    ("HedgehogFeatureMap/share_qk='yes'", lambda e: HedgehogFeatureMap(share_qk="yes"), V, ["share_qk='yes'"]),
    ("FFNFeatureMap/depth=4", lambda e: FFNFeatureMap(depth=4), V, ["depth=4"]),
    ("FFNFeatureMap/feature_dim=0", lambda e: FFNFeatureMap(feature_dim=0), V, ["feature_dim=0"]),
    (
        "GLUFeatureMap/hidden_activation",
        lambda e: GLUFeatureMap(depth=2, hidden_activation="swishy"),
        V,
        ["hidden_activation='swishy'"],
    ),
    (
        "OGLUFeatureMap/orthogonal_penalty=-1",
        lambda e: OGLUFeatureMap(orthogonal_penalty=-1.0),
        V,
        ["orthogonal_penalty=-1.0"],
    ),
    (
        "OGLUFeatureMap/orthogonal_penalty=nan",
        lambda e: OGLUFeatureMap(orthogonal_penalty=float("nan")),
        V,
        ["orthogonal_penalty=nan"],
    ),
    ("AOGLUFeatureMap/rank=0", lambda e: AOGLUFeatureMap(rank=0), V, ["rank=0"]),
    ("FeatureMap.__call__/rank 3 input", lambda e: feature_maps.get("elu")(o(1, 4, 8)), V, ["rank 4", "(1, 4, 8)"]),
    (
        "FavorPlusFeatureMap.__call__/other H, D",
        lambda e: e.built_favor(o(1, 3, 2, 5)),
        V,
        ["D=4", "inputs.shape=(1, 3, 2, 5)"],
    ),
    ("FavorPlusFeatureMap.redraw/unbuilt", lambda e: FavorPlusFeatureMap().redraw(), V, ["built=False"]),
    ("FavorPlusFeatureMap.redraw/seed=-1", lambda e: e.built_favor.redraw(seed=-1), V, ["seed=-1"]),
    # --- LinearAttention
    ("LinearAttention/num_heads=0", lambda e: LinearAttention(num_heads=0, key_dim=4), V, ["num_heads=0"]),
    ("LinearAttention/key_dim=-1", lambda e: LinearAttention(num_heads=2, key_dim=-1), V, ["key_dim=-1"]),
    ("LinearAttention/value_dim=0", lambda e: LinearAttention(2, 4, value_dim=0), V, ["value_dim=0"]),
    ("LinearAttention/chunk_size=0", lambda e: LinearAttention(2, 4, chunk_size=0), V, ["chunk_size=0"]),
    ("LinearAttention/dropout=1.0", lambda e: LinearAttention(2, 4, dropout=1.0), V, ["dropout=1.0"]),
    ("LinearAttention/epsilon=-1", lambda e: LinearAttention(2, 4, epsilon=-1), V, ["epsilon=-1"]),
    (
        "LinearAttention/linear_weight=3e38",
        lambda e: LinearAttention(2, 4, window_size=2, linear_weight=3e38),
        V,
        ["linear_weight=3e+38", "(0, 2**63]"],
    ),
    (
        "LinearAttention/output_shape=(4, 4)",
        lambda e: LinearAttention(2, 4, output_shape=(4, 4)),
        V,
        ["output_shape=(4, 4)"],
    ),
    (
        "LinearAttention/unknown feature_map",
        lambda e: LinearAttention(2, 4, feature_map="exp"),
        V,
        ["feature_map='exp'"],
    ),
    ("LinearAttention/feature_map=3", lambda e: LinearAttention(2, 4, feature_map=3), V, ["feature_map=3"]),
    ("LinearAttention.call/query rank 2", lambda e: LinearAttention(2, 4)(o(2, 8), o(2, 8)), V, ["query", "(2, 8)"]),
    (
        "LinearAttention.call/key, value lengths",
        lambda e: LinearAttention(2, 4)(o(1, 3, 8), o(1, 5, 8), key=o(1, 4, 8)),
        V,
        ["key.shape=(1, 4, 8)", "value.shape=(1, 5, 8)"],
    ),
    (
        "LinearAttention.call/attention_mask",
        lambda e: e.attention(o(1, 3, 8), o(1, 3, 8), attention_mask=o(1, 3, 3)),
        V,
        ["attention_mask", "(1, 3, 3)"],
    ),
    (
        "LinearAttention.call/causal with T != S",
        lambda e: e.attention(o(1, 3, 8), o(1, 5, 8), use_causal_mask=True),
        V,
        ["use_causal_mask", "query.shape=(1, 3, 8)", "key.shape=(1, 5, 8)"],
    ),
    (
        "LinearAttention.call/key_mask length",
        lambda e: e.attention(o(1, 3, 8), o(1, 3, 8), key_mask=o(1, 4)),
        V,
        ["key_mask.shape=(1, 4)"],
    ),
    (
        "LinearAttention.call/key_mask rank 3",
        lambda e: e.attention(o(1, 3, 8), o(1, 3, 8), key_mask=o(1, 3, 1)),
        V,
        ["key_mask", "(1, 3, 1)"],
    ),
    (
        "LinearAttention.call/initial_state shape",
        lambda e: e.attention(o(1, 3, 8), o(1, 3, 8), use_causal_mask=True, initial_state=(z(1, 2, 4, 3), z(1, 2, 4))),
        V,
        ["initial_state", "(1, 2, 4, 3)"],
    ),
    (
        "LinearAttention.step/query_t rank 3",
        lambda e: e.attention.step(o(1, 1, 8), o(1, 8), e.attention.get_initial_state(1)),
        V,
        ["query_t", "(1, 1, 8)"],
    ),
    (
        "LinearAttention.step/state batch",
        lambda e: e.attention.step(o(2, 8), o(2, 8), e.attention.get_initial_state(3)),
        V,
        ["state[0]", "(S)", "(2, 2, 4, 4)", "(3, 2, 4, 4)"],
    ),
    # --- EfficientAttention
    (
        "EfficientAttention/projection='linformer'",
        lambda e: EfficientAttention(2, 4, projection="linformer"),
        V,
        ["projection='linformer'"],
    ),
    (
        "EfficientAttention/missing projection_dim",
        lambda e: EfficientAttention(2, 4, projection="random", max_length=8),
        V,
        ["projection_dim=None"],
    ),
    (
        "EfficientAttention/projection_dim without projection",
        lambda e: EfficientAttention(2, 4, projection_dim=4),
        V,
        ["projection_dim=4"],
    ),
    ("EfficientAttention/delta=nan", lambda e: EfficientAttention(2, 4, delta=float("nan")), V, ["delta=nan"]),
    ("EfficientAttention/seed=-1", lambda e: EfficientAttention(2, 4, seed=-1), V, ["seed=-1"]),
    (
        "EfficientAttention.call/causal",
        lambda e: EfficientAttention(2, 4)(o(1, 3, 8), o(1, 3, 8), use_causal_mask=True),
        V,
        ["use_causal_mask"],
    ),
    (
        "EfficientAttention.call/keys beyond max_length",
        lambda e: EfficientAttention(2, 4, projection="random", projection_dim=2, max_length=4, seed=0)(
            o(1, 6, 8), o(1, 6, 8)
        ),
        V,
        ["max_length", "6"],
    ),
    # --- LinearAttentionCell
    ("LinearAttentionCell/attention=3", lambda e: LinearAttentionCell(3), V, ["attention=3"]),
    (
        "LinearAttentionCell.unpack_state/one state",
        lambda e: LinearAttentionCell(e.attention).unpack_state([z(1, 32)]),
        V,
        ["states"],
    ),
    (
        "LinearAttentionCell.unpack_state/wrong size",
        lambda e: LinearAttentionCell(e.attention).unpack_state([z(1, 33), z(1, 8)]),
        V,
        ["states[0]", "[B, 32]", "(1, 33)"],
    ),
    (
        "LinearAttentionCell.build/rank 3 step input",
        lambda e: LinearAttentionCell(LinearAttention(2, 4)).build((1, 3, 8)),
        V,
        ["rank 2", "(1, 3, 8)"],
    ),
    # --- transformer blocks
    (
        "LinearTransformerEncoder/num_heads=0",
        lambda e: LinearTransformerEncoder(num_heads=0, intermediate_dim=8),
        V,
        ["num_heads=0"],
    ),
    (
        "LinearTransformerEncoder/intermediate_dim=-1",
        lambda e: LinearTransformerEncoder(num_heads=2, intermediate_dim=-1),
        V,
        ["intermediate_dim=-1"],
    ),
    ("LinearTransformerEncoder/dropout=1.5", lambda e: LinearTransformerEncoder(2, 8, dropout=1.5), V, ["dropout=1.5"]),
    (
        "LinearTransformerEncoder/layer_norm_epsilon=0",
        lambda e: LinearTransformerEncoder(2, 8, layer_norm_epsilon=0),
        V,
        ["layer_norm_epsilon=0"],
    ),
    (
        "LinearTransformerEncoder/unknown feature_map",
        lambda e: LinearTransformerEncoder(2, 8, feature_map="cosformer"),
        V,
        ["feature_map='cosformer'"],
    ),
    (
        "LinearTransformerEncoder.call/inputs rank 2",
        lambda e: LinearTransformerEncoder(2, 8)(o(2, 8)),
        V,
        ["inputs.shape=(2, 8)"],
    ),
    (
        "LinearTransformerEncoder.build/dim % num_heads",
        lambda e: LinearTransformerEncoder(3, 8).build((None, None, 8)),
        V,
        ["hidden dim=8", "num_heads=3"],
    ),
    (
        "LinearTransformerEncoder.call/padding_mask rank 3",
        lambda e: e.encoder(o(1, 3, 8), padding_mask=o(1, 3, 1)),
        V,
        ["padding_mask.shape=(1, 3, 1)"],
    ),
    (
        "LinearTransformerDecoder.step/inputs_t rank 3",
        lambda e: e.decoder.step(o(1, 1, 8), e.decoder.get_initial_state(1)),
        V,
        ["inputs_t.shape=(1, 1, 8)"],
    ),
    (
        "LinearTransformerDecoder.step/inputs_t dim",
        lambda e: e.decoder.step(o(1, 6), e.decoder.get_initial_state(1)),
        V,
        ["inputs_t.shape=(1, 6)"],
    ),
    (
        "LinearTransformerDecoder.step/state shape",
        lambda e: e.decoder.step(o(1, 8), (z(1, 2, 4, 4), z(1, 2, 3))),
        V,
        ["state", "(1, 2, 3)"],
    ),
    (
        "LinearTransformerDecoder.get_initial_state/unbuilt",
        lambda e: LinearTransformerDecoder(2, 8).get_initial_state(1),
        V,
        ["batch_size=1", "unbuilt"],
    ),
    # --- LinearCausalLM
    (
        "LinearCausalLM/vocabulary_size=0",
        lambda e: LinearCausalLM(vocabulary_size=0, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16),
        V,
        ["vocabulary_size=0"],
    ),
    (
        "LinearCausalLM/hidden_dim % num_heads",
        lambda e: LinearCausalLM(vocabulary_size=16, num_layers=1, hidden_dim=10, num_heads=3, intermediate_dim=16),
        V,
        ["hidden_dim=10", "num_heads=3"],
    ),
    (
        "LinearCausalLM/max_sequence_length=0",
        lambda e: LinearCausalLM(
            vocabulary_size=16, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16, max_sequence_length=0
        ),
        V,
        ["max_sequence_length=0"],
    ),
    (
        "LinearCausalLM/dropout=2",
        lambda e: LinearCausalLM(
            vocabulary_size=16, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16, dropout=2.0
        ),
        V,
        ["dropout=2.0"],
    ),
    (
        "LinearCausalLM/unknown feature_map",
        lambda e: LinearCausalLM(
            vocabulary_size=16, num_layers=1, hidden_dim=8, num_heads=2, intermediate_dim=16, feature_map="rbf"
        ),
        V,
        ["feature_map='rbf'"],
    ),
    ("LinearCausalLM.call/float token ids", lambda e: e.lm(o(2, 3)), V, ["token_ids.dtype=", "float32"]),
    (
        "LinearCausalLM.call/token ids rank 3",
        lambda e: e.lm(np.zeros((2, 3, 1), "int32")),
        V,
        ["token_ids.shape=(2, 3, 1)"],
    ),
    (
        "LinearCausalLM.call/padding_mask shape",
        lambda e: e.lm(np.zeros((2, 3), "int32"), padding_mask=np.ones((2, 4), bool)),
        V,
        ["padding_mask.shape=(2, 4)"],
    ),
    (
        "LinearCausalLM.call/longer than max_sequence_length",
        lambda e: e.lm_positions(np.zeros((1, 7), "int32")),
        V,
        ["max_sequence_length=6", "(1, 7)"],
    ),
    (
        "LinearCausalLM.generate/prompt rank 1",
        lambda e: e.lm.generate(np.array([1, 2]), max_length=4),
        V,
        ["prompt_ids.shape=(2,)"],
    ),
    (
        "LinearCausalLM.generate/empty prompt",
        lambda e: e.lm.generate(np.zeros((1, 0), "int32"), max_length=4),
        V,
        ["prompt_ids.shape=(1, 0)"],
    ),
    (
        "LinearCausalLM.generate/float prompt",
        lambda e: e.lm.generate(o(1, 2), max_length=4),
        V,
        ["prompt_ids", "dtype=float32"],
    ),
    (
        "LinearCausalLM.generate/id out of vocabulary",
        lambda e: e.lm.generate(np.array([[1, 16]]), max_length=4),
        V,
        ["prompt_ids", "max=16"],
    ),
    (
        "LinearCausalLM.generate/negative id",
        lambda e: e.lm.generate(np.array([[-1, 2]]), max_length=4),
        V,
        ["prompt_ids", "min=-1"],
    ),
    (
        "LinearCausalLM.generate/max_length < prompt",
        lambda e: e.lm.generate(np.array([[1, 2, 3]]), max_length=2),
        V,
        ["max_length=2"],
    ),
    (
        "LinearCausalLM.generate/max_length=True",
        lambda e: e.lm.generate(np.array([[1]]), max_length=True),
        V,
        ["max_length=True"],
    ),
    (
        "LinearCausalLM.generate/max_length > max_sequence_length",
        lambda e: e.lm_positions.generate(np.array([[1]]), max_length=9),
        V,
        ["max_length=9"],
    ),
    (
        "LinearCausalLM.generate/right-padded mask",
        lambda e: e.lm.generate(np.array([[1, 2]]), max_length=4, padding_mask=np.array([[1, 0]])),
        V,
        ["padding_mask=[[1, 0]]"],
    ),
    (
        "LinearCausalLM.generate/mask shape",
        lambda e: e.lm.generate(np.array([[1, 2]]), max_length=4, padding_mask=np.array([[1, 1, 1]])),
        V,
        ["padding_mask.shape=(1, 3)"],
    ),
    (
        "LinearCausalLM.generate/unknown sampler",
        lambda e: e.lm.generate(np.array([[1]]), max_length=3, sampler="beam"),
        V,
        ["sampler='beam'"],
    ),
    (
        "LinearCausalLM.generate/block_size=0",
        lambda e: e.lm.generate(np.array([[1]]), max_length=3, block_size=0),
        V,
        ["block_size=0"],
    ),
    (
        "LinearCausalLM.step/token_t rank 2",
        lambda e: e.lm.step(np.zeros((1, 1), "int32"), e.lm.get_initial_state(1)),
        V,
        ["token_t.shape=(1, 1)"],
    ),
    (
        "LinearCausalLM.step/state length",
        lambda e: e.lm.step(np.zeros((1,), "int32"), e.lm.get_initial_state(1)[:2]),
        V,
        ["state", "3 tensors", "2 entries"],
    ),
    (
        "LinearCausalLM.step/state S shape",
        lambda e: e.lm.step(np.zeros((1,), "int32"), [z(1, 2, 4, 5), z(1, 2, 4), np.zeros((1,), "int32")]),
        V,
        ["state[0]", "decoder_block_0/S", "(1, 2, 4, 5)"],
    ),
    (
        "LinearCausalLM.step/position shape",
        lambda e: e.lm.step(np.zeros((1,), "int32"), e.lm.get_initial_state(1)[:2] + [np.zeros((1, 1), "int32")]),
        V,
        ["state[2]", "position", "(1, 1)"],
    ),
    (
        "LinearCausalLM.step/token_t out of vocabulary",
        lambda e: e.lm.step(np.array([16], "int32"), e.lm.get_initial_state(1)),
        V,
        ["token_t", "[0, 16)", "max=16"],
    ),
    (
        "LinearCausalLM.call/negative token id",
        lambda e: e.lm(np.array([[1, -1, 2]], "int32")),
        V,
        ["token_ids", "[0, 16)", "min=-1"],
    ),
    (
        "LinearCausalLM.call/token id = vocabulary_size",
        lambda e: e.lm(np.array([[1, 16]], "int32")),
        V,
        ["token_ids", "max=16"],
    ),
    (
        "LinearCausalLM.call/int64 id 2**32 + 3 (wraps to 3 in int32)",
        lambda e: e.lm(np.array([[1, 2**32 + 3]], "int64")),
        V,
        ["token_ids", "[0, 16)", "max=4294967299", "int64"],
    ),
    (
        "LinearCausalLM.call/zero-length rows",
        lambda e: e.lm(np.zeros((2, 0), "int32")),
        V,
        ["token_ids", "token_ids.shape=(2, 0)"],
    ),
    (
        "LinearAttention.call/query dim differs from build",
        lambda e: e.attention(o(1, 3, 6), o(1, 3, 8)),
        V,
        ["built for `query` of last dim 8", "query.shape=(1, 3, 6)"],
    ),
    (
        "LinearAttention.call/value dim differs from build",
        lambda e: e.attention(o(1, 3, 8), o(1, 3, 5)),
        V,
        ["`value` of last dim 8", "value.shape=(1, 3, 5)"],
    ),
    (
        "EfficientAttention.call/key dim differs from build",
        lambda e: _built(EfficientAttention(2, 4), (None, None, 8), (None, None, 8))(
            o(1, 3, 8), o(1, 3, 8), key=o(1, 3, 7)
        ),
        V,
        ["`key` of last dim 8", "key.shape=(1, 3, 7)"],
    ),
    (
        "LinearCausalLM.call_with_state/state batch",
        lambda e: e.lm.call_with_state(np.zeros((2, 3), "int32"), e.lm.get_initial_state(1)),
        V,
        ["state", "(1, 2, 4, 4)"],
    ),
    (
        "LinearCausalLM.call_with_state/past max_sequence_length",
        lambda e: e.lm_positions.call_with_state(
            np.ones((1, 3), "int32"), e.lm_positions.get_initial_state(1)[:-1] + [np.array([4], "int32")]
        ),
        V,
        ["token_ids", "max_sequence_length=6", "state position=4", "token_ids.shape=(1, 3)"],
    ),
    (
        "LinearCausalLM.step/past max_sequence_length",
        lambda e: e.lm_positions.step(
            np.array([1], "int32"), e.lm_positions.get_initial_state(1)[:-1] + [np.array([6], "int32")]
        ),
        V,
        ["token_t", "max_sequence_length=6", "(state[-1])=6"],
    ),
    (
        "LinearCausalLM.generate/seed='a'",
        lambda e: e.lm.generate(np.array([[1]]), max_length=3, sampler="random", seed="a"),
        V,
        ["seed='a'"],
    ),
    (
        "LinearCausalLM.predict/id out of vocabulary",
        lambda e: e.lm.predict(np.full((2, 3), 16, "int32"), verbose=0),
        tf.errors.InvalidArgumentError,
        ["`token_ids` must be in [0, 16)"],
    ),
    (
        "LinearAttention.call/return_attention_scores=True",
        lambda e: e.attention(o(1, 3, 8), o(1, 3, 8), return_attention_scores=True),
        V,
        ["return_attention_scores=True"],
    ),
    (
        "LinearAttention.call/value batch 1, query batch 2",
        lambda e: e.attention(o(2, 3, 8), o(1, 3, 8)),
        V,
        ["same batch size", "query.shape=(2, 3, 8)", "value.shape=(1, 3, 8)"],
    ),
    # --- samplers, regularizers, callbacks
    ("samplers.get/unknown", lambda e: samplers.get("nucleus"), V, ["sampler='nucleus'"]),
    ("samplers.get/wrong type", lambda e: samplers.get(3), V, ["sampler=3"]),
    ("samplers.deserialize/unknown", lambda e: samplers.deserialize({"class_name": "Beam"}), V, ["'Beam'"]),
    ("TopKSampler/k=0", lambda e: samplers.TopKSampler(k=0), V, ["k=0"]),
    ("TopPSampler/p=1.5", lambda e: samplers.TopPSampler(p=1.5), V, ["p=1.5"]),
    ("RandomSampler/temperature=-1", lambda e: samplers.RandomSampler(temperature=-1), V, ["temperature=-1"]),
    (
        "RandomSampler/temperature=nan",
        lambda e: samplers.RandomSampler(temperature=float("nan")),
        V,
        ["temperature=nan"],
    ),
    ("Sampler.__call__/logits rank 3", lambda e: samplers.GreedySampler()(o(1, 2, 5)), V, ["logits.shape=(1, 2, 5)"]),
    ("Sampler.__call__/random without seed", lambda e: samplers.RandomSampler()(o(1, 5)), V, ["seed=None"]),
    ("OrthogonalRegularizer/factor=-1", lambda e: OrthogonalRegularizer(factor=-1), V, ["factor=-1"]),
    ("OrthogonalRegularizer/factor=inf", lambda e: OrthogonalRegularizer(factor=float("inf")), V, ["factor=inf"]),
    ("OrthogonalRegularizer.__call__/rank 1", lambda e: OrthogonalRegularizer()(o(4)), V, ["x.shape=(4,)"]),
    (
        "RedrawRandomFeatures/every_n_steps=0",
        lambda e: callbacks.RedrawRandomFeatures(every_n_steps=0),
        V,
        ["every_n_steps=0"],
    ),
    # --- distill
    (
        "distill_attention/epochs=0",
        lambda e: distill.distill_attention(e.functional, o(2, 3, 8), epochs=0),
        V,
        ["epochs=0"],
    ),
    (
        "distill_attention/verbose=3",
        lambda e: distill.distill_attention(e.functional, o(2, 3, 8), verbose=3),
        V,
        ["verbose=3"],
    ),
    (
        "distill_attention/causal='yes'",
        lambda e: distill.distill_attention(e.functional, o(2, 3, 8), causal="yes"),
        V,
        ["causal='yes'"],
    ),
    (
        "distill_attention/batch_size=0",
        lambda e: distill.distill_attention(e.functional, o(2, 3, 8), batch_size=0),
        V,
        ["batch_size=0"],
    ),
    (
        "distill_attention/no trainable map",
        lambda e: distill.distill_attention(e.functional, o(2, 3, 8)),
        V,
        ["model=", "trainable feature map"],
    ),
    (
        "distill_attention/unknown layer name",
        lambda e: distill.distill_attention(e.functional, o(2, 3, 8), layers=["nope"]),
        V,
        ["'nope'"],
    ),
    ("attention_kl/steps=0", lambda e: distill.attention_kl(e.functional, o(2, 3, 8), steps=0), V, ["steps=0"]),
    # --- export: SavedModel
    (
        "export_saved_model/not a model",
        lambda e: export.export_saved_model("model.keras", e.path("sm_a")),
        V,
        ["model=str"],
    ),
    (
        "export_saved_model/unbuilt model",
        lambda e: export.export_saved_model(keras.Sequential([keras.layers.Dense(2)]), e.path("sm_b")),
        V,
        ["built=False"],
    ),
    (
        "export_saved_model/base_dir is a file",
        lambda e: export.export_saved_model(e.functional, e.a_file),
        V,
        ["base_dir=", "a_file.txt"],
    ),
    (
        "export_saved_model/version=-1",
        lambda e: export.export_saved_model(e.functional, e.path("sm_c"), version=-1),
        V,
        ["version=-1"],
    ),
    (
        "export_saved_model/existing version",
        lambda e: export.export_saved_model(e.functional, e.existing_version_base, version=1),
        V,
        ["version=1", "already exists"],
    ),
    (
        "export_saved_model/input_signature entry",
        lambda e: export.export_saved_model(e.functional, e.path("sm_d"), input_signature=[3]),
        V,
        ["input_signature[0]=3"],
    ),
    (
        "SavedModelRunner/missing dir",
        lambda e: export.SavedModelRunner(e.path("no_such_dir")),
        V,
        ["export_dir=", "no_such_dir"],
    ),
    (
        "SavedModelRunner/dir without saved_model.pb",
        lambda e: export.SavedModelRunner(e.empty_dir),
        V,
        ["export_dir=", "empty_dir"],
    ),
    (
        "SavedModelRunner/corrupt saved_model.pb",
        lambda e: export.SavedModelRunner(e.corrupt_saved_model),
        V,
        ["export_dir=", "corrupt_sm"],
    ),
    (
        "SavedModelRunner/damaged variables file",
        lambda e: export.SavedModelRunner(e.damaged_saved_model),
        V,
        ["Read less bytes than requested", "variables/variables.data-00000-of-00001 is truncated", "damaged_sm"],
    ),
    (
        "SavedModelRunner.run/unknown signature",
        lambda e: e.runner.run("predict", {"x": o(1, 3)}),
        V,
        ["signature_name='predict'"],
    ),
    (
        "SavedModelRunner.run/missing input",
        lambda e: e.runner.run("serving_default", {"features": o(1, 3)}),
        V,
        ["missing=['x']", "unexpected=['features']"],
    ),
    (
        "read_description/dir without description",
        lambda e: export.read_description(e.empty_dir),
        V,
        ["export_dir=", "empty_dir"],
    ),
    ("latest_version_dir/no version", lambda e: export.latest_version_dir(e.empty_dir), V, ["base_dir=", "empty_dir"]),
    ("verify/not a model", lambda e: export.verify("model", saved_model_dir=e.other_saved_model), V, ["model=str"]),
    (
        "verify/corrupt SavedModel",
        lambda e: export.verify(e.functional, saved_model_dir=e.corrupt_saved_model),
        V,
        ["export_dir=", "corrupt_sm"],
    ),
    (
        "verify/SavedModel of another model",
        lambda e: export.verify(e.functional, saved_model_dir=e.other_saved_model),
        V,
        ["takes inputs ['x']", "missing=['x']", "unexpected=['features']"],
    ),
    (
        "verify/ONNX of another model",
        lambda e: export.verify(e.functional, onnx_path=e.identity_onnx),
        V,
        ["missing=['x']", "unexpected=['features']"],
    ),
    (
        "verify/corrupt ONNX",
        lambda e: export.verify(e.functional, onnx_path=e.corrupt_onnx),
        V,
        ["path=", "corrupt.onnx"],
    ),
    # --- export: ONNX
    ("export_onnx/not a model", lambda e: export.export_onnx(object(), e.path("x.onnx")), V, ["model=object"]),
    (
        "export_onnx/path is a directory",
        lambda e: export.export_onnx(e.functional, e.empty_dir),
        V,
        ["path=", "empty_dir"],
    ),
    (
        "export_onnx/step_path is a directory",
        lambda e: export.export_onnx(e.functional, e.path("y.onnx"), step_path=e.empty_dir),
        V,
        ["step_path=", "empty_dir"],
    ),
    (
        "export_onnx/parent is a file",
        lambda e: export.export_onnx(e.functional, os.path.join(e.a_file, "m.onnx")),
        V,
        ["path=", "a_file.txt"],
    ),
    (
        "OnnxPredictor/missing file",
        lambda e: export.OnnxPredictor(e.path("missing.onnx")),
        V,
        ["path=", "missing.onnx"],
    ),
    ("OnnxPredictor/directory", lambda e: export.OnnxPredictor(e.empty_dir), V, ["path=", "empty_dir"]),
    ("OnnxPredictor/corrupt file", lambda e: export.OnnxPredictor(e.corrupt_onnx), V, ["path=", "corrupt.onnx"]),
    ("OnnxPredictor/empty file", lambda e: export.OnnxPredictor(e.empty_onnx), V, ["path=", "empty.onnx"]),
    ("OnnxPredictor/device='tpu'", lambda e: export.OnnxPredictor(e.identity_onnx, device="tpu"), V, ["device='tpu'"]),
    ("OnnxPredictor.predict/wrong rank", lambda e: e.predictor({"x": o(3)}), V, ["x.shape=(3,)"]),
    (
        "OnnxPredictor.predict/fixed dim",
        lambda e: e.predictor({"x": o(2, 4)}),
        V,
        ["axis 1 must be 3", "x.shape=(2, 4)"],
    ),
    (
        "OnnxPredictor.predict/integer for float",
        lambda e: e.predictor({"x": np.zeros((2, 3), "int32")}),
        V,
        ["x.dtype=int32"],
    ),
    (
        "OnnxPredictor.predict/missing input",
        lambda e: e.predictor({"features": o(2, 3)}),
        V,
        ["missing=['x']", "unexpected=['features']"],
    ),
    ("OnnxPredictor.predict/list length", lambda e: e.predictor([o(2, 3), o(2, 3)]), V, ["2 inputs"]),
    (
        "OnnxGenerator/not a step graph",
        lambda e: export.OnnxGenerator(e.identity_onnx, device="cpu"),
        V,
        ["inputs=['x']"],
    ),
    (
        "OnnxGenerator/corrupt file",
        lambda e: export.OnnxGenerator(e.corrupt_onnx, device="cpu"),
        V,
        ["path=", "corrupt.onnx"],
    ),
    (
        "OnnxGenerator.generate/prompt rank 1",
        lambda e: e.generator.generate(np.array([1, 2], "int32"), 4),
        V,
        ["prompt_ids", "(2,)"],
    ),
    (
        "OnnxGenerator.generate/float prompt",
        lambda e: e.generator.generate(np.ones((1, 2), "float32"), 4),
        V,
        ["prompt_ids", "float32"],
    ),
    (
        "OnnxGenerator.generate/empty prompt",
        lambda e: e.generator.generate(np.zeros((1, 0), "int32"), 4),
        V,
        ["prompt_ids.shape=(1, 0)"],
    ),
    (
        "OnnxGenerator.generate/max_length=0",
        lambda e: e.generator.generate(np.ones((1, 2), "int32"), 0),
        V,
        ["max_length=0"],
    ),
    (
        "OnnxGenerator.generate/temperature=nan",
        lambda e: e.generator.generate(np.ones((1, 2), "int32"), 4, temperature=float("nan")),
        V,
        ["temperature=nan"],
    ),
    (
        "read_warmup_requests/missing file",
        lambda e: export.read_warmup_requests(e.path("missing_warmup")),
        V,
        ["path=", "missing_warmup"],
    ),
    (
        "read_warmup_requests/corrupt file",
        lambda e: export.read_warmup_requests(e.corrupt_onnx),
        V,
        ["TFRecord", "path=", "corrupt.onnx"],
    ),
    (
        "read_warmup_requests/records not PredictionLog",
        lambda e: export.read_warmup_requests(e.not_prediction_logs),
        V,
        ["PredictionLog", "records.tfrecord"],
    ),
    (
        "write_warmup_requests/model_name=''",
        lambda e: export.write_warmup_requests(e.path("w"), None, ""),
        V,
        ["model_name=''"],
    ),
    (
        "write_warmup_requests/batch_size=0",
        lambda e: export.write_warmup_requests(e.path("w"), None, "m", batch_size=0),
        V,
        ["batch_size=0"],
    ),
    ("check_pair/corrupt file", lambda e: export.check_pair(e.corrupt_onnx), V, ["path=", "corrupt.onnx"]),
    ("check_pair/missing file", lambda e: export.check_pair(e.path("missing.onnx")), V, ["path=", "missing.onnx"]),
]


@pytest.mark.parametrize("thunk, exc, fragments", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_gets_a_clear_error(env, thunk, exc, fragments):
    with pytest.raises(exc) as info:
        thunk(env)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"


def test_return_attention_scores_false_is_accepted(env):
    """`keras.layers.MultiHeadAttention` callers pass it; False changes nothing."""
    x = np.random.default_rng(0).normal(size=(1, 3, 8)).astype(F)
    np.testing.assert_array_equal(
        np.asarray(env.attention(x, x, return_attention_scores=False)), np.asarray(env.attention(x, x))
    )


# ------------------------------------------------------------------- CLI
# The CLI turns ValueErrors into "error: ..." on stderr and exit code 2;
# argparse does the same for malformed options.
CLI_ROWS = [
    (
        "cli export/missing model",
        lambda e: ["export", e.path("missing.keras"), "--out", e.path("out1")],
        ["MODEL=", "missing.keras"],
    ),
    (
        "cli export/corrupt .keras",
        lambda e: ["export", e.corrupt_keras, "--out", e.path("out2")],
        ["MODEL=", "corrupt.keras"],
    ),
    ("cli export/--out is a file", lambda e: ["export", e.corrupt_keras, "--out", e.a_file], ["--out=", "a_file.txt"]),
    (
        "cli export/--format tflite",
        lambda e: ["export", e.corrupt_keras, "--out", e.path("o"), "--format", "tflite"],
        ["--format", "'tflite'"],
    ),
    ("cli verify/dir without manifest", lambda e: ["verify", e.empty_dir], ["DIR=", "empty_dir"]),
    ("cli verify/--shapes 3by4", lambda e: ["verify", e.empty_dir, "--shapes", "3by4"], ["--shapes", "'3by4'"]),
    ("cli verify/--device tpu", lambda e: ["verify", e.empty_dir, "--device", "tpu"], ["--device", "'tpu'"]),
]


@pytest.mark.parametrize("argv, fragments", [r[1:] for r in CLI_ROWS], ids=[r[0] for r in CLI_ROWS])
def test_cli_bad_input_exits_2_with_a_message(env, argv, fragments):
    code, err = _cli(env, argv(env))
    assert code == 2, err
    for fragment in fragments:
        assert fragment in err, f"{fragment!r} not in: {err}"
    assert "Traceback" not in err


def test_cli_verify_manifest_naming_a_corrupt_keras_file(env):
    d = env.path("manifest_dir")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"models": {"m": {"keras_model": os.path.relpath(env.corrupt_keras, d)}}}, f)
    code, err = _cli(env, ["verify", d])
    assert code == 2 and "MODEL=" in err and "corrupt.keras" in err, err


# ------------------------------------------------------------- NaN inputs
# NaN is data, not a shape error: the ops do not scan their inputs (that would
# cost a reduction and a host sync per call). What is guaranteed is that a NaN
# goes only where the maths sends it.
def test_nan_in_a_real_token_is_never_hidden_and_stays_in_its_sequence():
    rng = np.random.default_rng(0)
    q = rng.uniform(0.1, 1, (2, 10, 1, 3)).astype(F)
    k = rng.uniform(0.1, 1, (2, 10, 1, 3)).astype(F)
    v = rng.normal(size=(2, 10, 1, 2)).astype(F)
    k[0, 6, 0, 1] = np.nan
    causal = np.asarray(la.linear_attention(q, k, v, causal=True, chunk_size=4))
    assert np.isnan(causal[0, 6:]).all()  # from the NaN key on: NaN, not silently hidden
    assert np.isfinite(causal[1]).all()  # the other sequence of the batch: untouched
    # Outputs before the NaN key, in the same sequence, may be NaN too: the
    # chunk states are combined by a matmul with a 0/1 triangle (docs/dev/hardening.md).
    q2 = q.copy()
    q2[0, 3, 0, 0] = np.nan
    non_causal = np.asarray(la.linear_attention(q2, np.full_like(k, 0.5), v))
    assert np.isnan(non_causal[0, 3]).all()
    assert np.isfinite(np.delete(non_causal[0], 3, axis=0)).all()


def test_nan_in_an_unused_query_never_reaches_the_state():
    rng = np.random.default_rng(1)
    q = rng.uniform(0.1, 1, (1, 6, 1, 3)).astype(F)
    k = rng.uniform(0.1, 1, (1, 6, 1, 3)).astype(F)
    v = rng.normal(size=(1, 6, 1, 2)).astype(F)
    q[0, 2] = np.nan
    out, (s, zz) = la.linear_attention(q, k, v, causal=True, chunk_size=4, return_state=True)
    assert np.isfinite(np.asarray(s)).all() and np.isfinite(np.asarray(zz)).all()
    out = np.asarray(out)
    assert np.isnan(out[0, 2]).all() and np.isfinite(np.delete(out[0], 2, axis=0)).all()


# ----------------------------------------------------- the docs table in sync
def _docs_rows():
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "dev", "hardening.md")
    with open(path) as f:
        return {line.strip() for line in f if line.startswith("| `")}


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_docs_table_lists_the_row_as_tested(row):
    """docs/dev/hardening.md shows each row with the error type and fragments this file checks."""
    name, _, error, fragments = row
    entry, case = name.split("/", 1)
    docs = _docs_rows()
    prefix = f"| `{entry}` | {case} | {error.__name__}: "
    matches = [line for line in docs if line.startswith(prefix)]
    assert matches, f"docs/dev/hardening.md has no row starting {prefix!r}"

    def shown(fragment):
        return f"`` {fragment} ``" if "`" in fragment else f"`{fragment}`"

    assert matches[0] == prefix + ", ".join(shown(f) for f in fragments) + " |"
