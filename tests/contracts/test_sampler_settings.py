"""One rule table for sampler settings, the same answer on every front end.

Each row of the table (docs/decoding.md, "Sampler settings";
`keras_linattn._sampler_settings`) is a setting of ``(temperature, top_k,
top_p, seed)``; each is tried on every front end that samples, from one
tiny LM exported once per run (`tests._shared_exports.limited_export`,
weights at scale 0.5: logits well apart, so tokens compare exactly):

- Keras: `LinearCausalLM.generate` with the built-in sampler of those
  settings, and `samplers.sample` called directly (Python numbers, and
  tensors as in the graphs);
- the SavedModel ``generate_sampled`` signature, run as TF Serving runs it
  (`SavedModelRunner`);
- ONNX: ``lm_generate.onnx`` in onnxruntime, and `OnnxGenerator.generate`.

An accepted row gives Keras' tokens everywhere; a temperature below
``2^-126`` (0 included) gives the greedy tokens. A refused row is refused
everywhere: ``ValueError`` naming the value in Python, the SavedModel's
run-time assertion (``InvalidArgumentError``) naming the setting, and
``output_ids`` full of -1 from the ONNX graph and from `sample` with tensor
settings (one -1 per row).
"""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras_linattn
from keras_linattn import export, samplers
from tests import _shared_exports

pytestmark = [pytest.mark.tf_only("SavedModel and ONNX exports"), pytest.mark.numeric]

V = _shared_exports.LIMITED_VOCAB
TINY = 2.0**-126  # float32's smallest normal number: the rule table's floor
NAN, INF = float("nan"), float("inf")
PROMPT = np.array([[0, 5, 6], [1, 2, 3]], "int32")
MASK = np.array([[0, 1, 1], [1, 1, 1]], "int32")  # row 0 left-padded
MAX_LENGTH = 10

# (row, temperature, top_k, top_p, seed)
ACCEPTED = [
    ("random", 0.7, 0, 1.0, 3),
    ("top_k", 0.9, 5, 1.0, 3),
    ("top_p", 1.1, 0, 0.8, 3),
    ("top_p with a top_k cap", 1.0, 3, 0.9, 5),
    ("top_k above V keeps all", 1.0, V + 5, 1.0, 3),
    ("seed 0", 1.3, 0, 1.0, 0),
    ("seed 2**62", 1.3, 0, 1.0, 2**62),
    ("top_p at the floor 2**-126", 1.0, 0, TINY, 3),
    # Below the floor (0 and the subnormals): greedy on every front end.
    ("temperature 0 is greedy", 0.0, 0, 1.0, 3),
    ("temperature 1e-42 is greedy", 1e-42, 0, 1.0, 3),
    ("temperature 1e-42 with top_p is greedy", 1e-42, 4, 0.5, 3),
    # At the floor: sampling, and logits / temperature overflows float32 unless the kernel shifts by the max.
    ("temperature 2**-126 samples without overflow", TINY, 0, 1.0, 3),
]
# Rows whose tokens are the greedy ones: the greedy temperatures, and settings whose only candidate is
# the best token (logits well apart: a Gumbel noise of at most ~20 cannot beat gaps over 2**126).
GREEDY_ROWS = {
    "temperature 0 is greedy",
    "temperature 1e-42 is greedy",
    "temperature 1e-42 with top_p is greedy",
    "temperature 2**-126 samples without overflow",
    "top_p at the floor 2**-126",
}

# (row, temperature, top_k, top_p, seed, the setting refused, its value)
REFUSED = [
    ("top_p=0", 1.0, 0, 0.0, 3, "top_p", 0.0),
    ("top_p=-0.5", 1.0, 0, -0.5, 3, "top_p", -0.5),
    ("top_p=1e-42 (subnormal)", 1.0, 0, 1e-42, 3, "top_p", 1e-42),
    ("top_p=nan", 1.0, 0, NAN, 3, "top_p", NAN),
    ("top_p=1.5", 1.0, 0, 1.5, 3, "top_p", 1.5),
    ("top_p=inf", 1.0, 0, INF, 3, "top_p", INF),
    ("temperature=nan", NAN, 0, 1.0, 3, "temperature", NAN),
    ("temperature=-1", -1.0, 0, 1.0, 3, "temperature", -1.0),
    ("temperature=-inf", -INF, 0, 1.0, 3, "temperature", -INF),
    ("temperature=inf", INF, 0, 1.0, 3, "temperature", INF),
    ("temperature=-0.0", -0.0, 0, 1.0, 3, "temperature", -0.0),
    ("temperature=-1e-42 (subnormal)", -1e-42, 0, 1.0, 3, "temperature", -1e-42),
    ("top_k=-3", 1.0, -3, 1.0, 3, "top_k", -3),
    ("seed=-1", 1.0, 0, 1.0, -1, "seed", -1),
]
FRONT_ENDS = ["keras generate", "samplers.sample", "saved_model generate_sampled", "onnx graph", "OnnxGenerator"]


def keras_sampler(temperature, top_k, top_p):
    """The built-in sampler of these settings (its constructor checks them: `p`, `k`, `temperature`)."""
    if top_p == 1.0 and top_k == 0:
        return samplers.RandomSampler(temperature=temperature)
    if top_p == 1.0:
        return samplers.TopKSampler(k=top_k, temperature=temperature)
    return samplers.TopPSampler(p=top_p, k=top_k or None, temperature=temperature)


class Env:
    def __init__(self):
        self.lm, self.version_dir, self.paths = _shared_exports.limited_export()
        self.runner = export.SavedModelRunner(self.version_dir)
        self.generator = export.OnnxGenerator(self.paths["step"], device="cpu")
        self.graph = export.OnnxPredictor(self.paths["generate"], device="cpu")
        self._keras = {}
        self.greedy = np.asarray(self.lm.generate(PROMPT, MAX_LENGTH, padding_mask=MASK))
        self.logits = np.asarray(self.lm(PROMPT))[:, -1]  # [B, V]: what `sample` is tried on
        self.tensor_sample = tf.function(samplers.sample)

    def keras_generate(self, temperature, top_k, top_p, seed):
        sampler = keras_sampler(temperature, top_k, top_p)
        return np.asarray(self.lm.generate(PROMPT, MAX_LENGTH, sampler=sampler, seed=seed, padding_mask=MASK))

    def keras_tokens(self, row):
        """Keras' tokens for an accepted row: the reference of the other front ends."""
        if row[0] not in self._keras:
            self._keras[row[0]] = self.keras_generate(*row[1:5])
        return self._keras[row[0]]

    def feeds(self, temperature, top_k, top_p, seed):
        return {
            "prompt_ids": PROMPT,
            "padding_mask": MASK,
            "max_length": np.array(MAX_LENGTH, np.int32),
            "temperature": np.array(temperature, np.float32),
            "top_k": np.array(top_k, np.int32),
            "top_p": np.array(top_p, np.float32),
            "seed": np.array(seed, np.int64),
        }

    def saved_model(self, *settings):
        return self.runner.run("generate_sampled", self.feeds(*settings))["output_ids"]

    def onnx_graph(self, *settings):
        return self.graph.predict(self.feeds(*settings))["output_ids"]

    def onnx_generator(self, temperature, top_k, top_p, seed):
        sampler = keras_sampler(temperature, top_k, top_p)
        return self.generator.generate(PROMPT, MAX_LENGTH, sampler=sampler, seed=seed, padding_mask=MASK)

    def sample_pair(self, temperature, top_k, top_p):
        """`sample` with tensor settings (as the graphs call it) and with the same settings as numbers."""
        seed = np.array([3, 7], "int32")
        as_tensors = (
            tf.constant(np.float32(temperature)),
            tf.constant(np.int32(top_k)),
            tf.constant(np.float32(top_p)),
        )
        tensor = np.asarray(self.tensor_sample(self.logits, seed, *as_tensors))
        return tensor, (lambda: np.asarray(samplers.sample(self.logits, seed, temperature, top_k, top_p)))


@pytest.fixture(scope="module")
def env():
    return Env()


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("row", ACCEPTED, ids=[r[0] for r in ACCEPTED])
def test_an_accepted_setting_gives_the_same_tokens_everywhere(env, row, front_end):
    name, temperature, top_k, top_p, seed = row
    if front_end == "samplers.sample":
        tensor, static = env.sample_pair(temperature, top_k, top_p)
        np.testing.assert_array_equal(tensor, static())
        assert ((tensor >= 0) & (tensor < V)).all(), tensor
        if name in GREEDY_ROWS:
            np.testing.assert_array_equal(tensor, env.logits.argmax(-1))
        return
    expected = env.keras_tokens(row)
    if name in GREEDY_ROWS:
        np.testing.assert_array_equal(expected, env.greedy)
    got = {
        "keras generate": lambda: expected,
        "saved_model generate_sampled": lambda: env.saved_model(temperature, top_k, top_p, seed),
        "onnx graph": lambda: env.onnx_graph(temperature, top_k, top_p, seed),
        "OnnxGenerator": lambda: env.onnx_generator(temperature, top_k, top_p, seed),
    }[front_end]()
    assert got.shape == (2, MAX_LENGTH)
    np.testing.assert_array_equal(got[:, :3], PROMPT)
    assert ((got >= 0) & (got < V)).all(), got
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("row", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_refused_setting_is_refused_everywhere(env, row, front_end):
    name, temperature, top_k, top_p, seed, setting, value = row
    settings = (temperature, top_k, top_p, seed)
    received = f"={value!r}"  # the Python name may be the sampler's (`p`, `k`) or the table's
    if front_end in ("keras generate", "OnnxGenerator"):
        call = env.keras_generate if front_end == "keras generate" else env.onnx_generator
        with pytest.raises(ValueError, match="must be") as info:
            call(*settings)
        assert received in str(info.value), str(info.value)
    elif front_end == "samplers.sample":
        if setting == "seed":
            pytest.skip("`sample` takes the per-token seed pair, not the generate seed")
        tensor, static = env.sample_pair(temperature, top_k, top_p)
        assert tensor.tolist() == [-1, -1]
        with pytest.raises(ValueError, match=f"`{setting}` must be") as info:
            static()
        assert received in str(info.value), str(info.value)
    elif front_end == "saved_model generate_sampled":
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"`{setting}` must be") as info:
            env.saved_model(*settings)
        assert "Received:" in str(info.value), str(info.value)[:2000]  # the assertion shows the value too
    else:
        out = env.onnx_graph(*settings)
        assert out.shape == (2, MAX_LENGTH)
        assert (out == -1).all(), out


# ------------------------------------------------ values only Python can hold
@pytest.mark.parametrize(
    "call, received",
    [
        (lambda e: e.lm.generate(PROMPT, MAX_LENGTH, sampler="random", seed=2**63), f"seed={2**63}"),
        (lambda e: e.generator.generate(PROMPT, MAX_LENGTH, sampler="random", seed=2**63), f"seed={2**63}"),
        (lambda e: e.generator.generate(PROMPT, MAX_LENGTH, temperature=-1.0), "temperature=-1.0"),
        # float32 +inf: what the graphs would receive
        (lambda e: samplers.RandomSampler(temperature=1e39), "temperature=1e+39"),
        (lambda e: samplers.TopKSampler(k=2**31), f"k={2**31}"),
        (lambda e: samplers.TopKSampler(k=True), "k=True"),
        (lambda e: samplers.TopPSampler(p="0.5"), "p='0.5'"),
    ],
    ids=[
        "generate seed 2**63",
        "OnnxGenerator seed 2**63",
        "OnnxGenerator temperature=-1",
        "1e39",
        "k=2**31",
        "bool",
        "str",
    ],
)
def test_python_only_values_are_refused(env, call, received):
    with pytest.raises(ValueError, match="must be") as info:
        call(env)
    assert received in str(info.value), str(info.value)


def test_onnx_generator_temperature_shorthand_follows_the_greedy_floor(env):
    """`OnnxGenerator.generate(temperature=...)`: below 2**-126 is greedy, as for every sampler."""
    for temperature in (0.0, 1e-42):
        got = env.generator.generate(PROMPT, MAX_LENGTH, temperature=temperature, seed=3, padding_mask=MASK)
        np.testing.assert_array_equal(got, env.greedy)


def test_the_python_rules_import_neither_tensorflow_nor_keras():
    """`keras_linattn._sampler_settings` loads with TensorFlow and Keras blocked (OnnxGenerator's checks)."""
    path = os.path.join(os.path.dirname(keras_linattn.__file__), "_sampler_settings.py")
    code = (
        "import importlib.util, sys\n"
        "sys.modules['tensorflow'] = None\n"
        "sys.modules['keras'] = None\n"
        f"spec = importlib.util.spec_from_file_location('rules', {path!r})\n"
        "rules = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(rules)\n"
        "print(rules.check_settings(0.5, 3, 0.9))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(0.5, 3, 0.9)"
    assert importlib.util.find_spec("keras_linattn._sampler_settings") is not None


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_a_temperature_at_the_floor_never_overflows(mode):
    """``logits / 2**-126`` is +inf for every logit above ~4: the kernel divides ``logits - max`` instead,
    so the best token stays the only candidate (Gumbel noise of at most ~20 cannot beat the gaps)."""
    logits = np.array([[10.0, 50.0, -5.0, 49.5], [3.0, -1.0, 2.5, 0.0]], "float32")  # [B, V]
    seed = tf.constant([1, 4], "int32")
    call = samplers.sample if mode == "eager" else tf.function(samplers.sample, jit_compile=mode == "xla")
    as_tensor = (tf.constant(np.float32(TINY)), tf.constant(np.int32(0)), tf.constant(np.float32(1.0)))
    for got in (
        call(logits, seed, TINY),
        call(logits, seed, *as_tensor),
        samplers.RandomSampler(temperature=TINY)(logits, seed),
        samplers.TopPSampler(p=0.9, temperature=TINY)(logits, seed),
    ):
        assert np.asarray(got).tolist() == [1, 0]
