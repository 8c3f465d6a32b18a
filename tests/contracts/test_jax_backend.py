"""The layers, every feature map and the causal LM on `KERAS_BACKEND=jax`.

Each check builds the same model on TensorFlow and, in a subprocess, on JAX
from the same saved weights, and compares outputs within the float32 error
model (two float32 computations: paths=2). Export stays on TensorFlow.
The same subprocess runs `generate` on JAX for the LM of
`tests/export/test_generate_parity.py` (one JAX start for both checks: each
start imports TensorFlow, keras-hub and JAX, and compiles JAX's ops anew).
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_linattn import feature_maps, samplers
from keras_linattn.layers import LinearAttention
from keras_linattn.models import LinearCausalLM
from tests._helpers import layer_conditioning, step_test_feature_map
from tests.export.test_generate_parity import VOCAB as GENERATE_VOCAB
from tests.export.test_generate_parity import _lm as _generate_lm
from tests.export.test_generate_parity import _prompts as _generate_prompts
from tests.tolerance import assert_close

pytest.importorskip("jax", reason="the `jax` extra (make test installs it)")

DIM, HEADS, KEY_DIM, T = 16, 2, 8, 11
MAPS = feature_maps.available()

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import keras
    from keras_linattn import feature_maps, samplers
    from keras_linattn.layers import LinearAttention
    from keras_linattn.models import LinearCausalLM

    assert keras.backend.backend() == "jax", keras.backend.backend()
    job = json.load(open(sys.argv[1]))
    x = np.load(job["x"])
    ids = np.load(job["ids"])
    out = {}
    for name, cfg in job["layers"].items():
        layer = LinearAttention.from_config(cfg)
        layer(x, x)
        saved = np.load(job["weights"][name])
        layer.set_weights([saved[f"w{i}"] for i in range(len(saved.files))])
        out[name + "/noncausal"] = np.asarray(layer(x, x))
        out[name + "/causal"] = np.asarray(layer(x, x, use_causal_mask=True))
    lm = LinearCausalLM.from_config(job["lm"])
    lm.load_weights(job["lm_weights"])
    out["lm/logits"] = np.asarray(lm(ids))
    state = lm.get_initial_state(ids.shape[0])
    steps = []
    for t in range(ids.shape[1]):
        logits, state = lm.step(ids[:, t], state)
        steps.append(np.asarray(logits))
    out["lm/steps"] = np.stack(steps, axis=1)
    gen = job["generate"]
    glm = LinearCausalLM(vocabulary_size=gen["vocab"], num_layers=2, hidden_dim=16, num_heads=2,
                         intermediate_dim=32, feature_map="elu")
    glm.load_weights(gen["weights"])
    prompt = np.load(gen["prompt"])
    out["generate/greedy"] = glm.generate(prompt, max_length=14)
    out["generate/top_k"] = glm.generate(
        prompt, max_length=14, sampler=samplers.get("top_k", k=5, temperature=0.9), seed=11
    )
    np.savez(job["out"], **out)
    """
)


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jax")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, T, DIM)).astype("float32")
    ids = rng.integers(0, 30, size=(2, 9)).astype("int32")
    np.save(tmp / "x.npy", x)
    np.save(tmp / "ids.npy", ids)
    layers, configs, weights = {}, {}, {}
    for name in MAPS:
        keras.utils.set_random_seed(1234)
        layer = LinearAttention(HEADS, KEY_DIM, feature_map=step_test_feature_map(name), chunk_size=4)
        layer(x, x)
        path = str(tmp / f"{name.replace('+', 'p')}.npz")
        np.savez(path, **{f"w{i}": w for i, w in enumerate(layer.get_weights())})
        layers[name], configs[name], weights[name] = layer, layer.get_config(), path
    keras.utils.set_random_seed(1234)
    lm = LinearCausalLM(vocabulary_size=30, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32)
    lm_weights = str(tmp / "lm.weights.h5")
    lm.save_weights(lm_weights)
    # tests/export/test_generate_parity.py's LM (elu, weights at scale 0.5) and prompts.
    keras.utils.set_random_seed(1234)
    generate_lm = _generate_lm("elu")
    generate_weights = str(tmp / "generate_lm.weights.h5")
    generate_lm.save_weights(generate_weights)
    prompt, _ = _generate_prompts(GENERATE_VOCAB)
    np.save(tmp / "prompt.npy", prompt)
    job = {
        "x": str(tmp / "x.npy"),
        "ids": str(tmp / "ids.npy"),
        "layers": configs,
        "weights": weights,
        "lm": lm.get_config(),
        "lm_weights": lm_weights,
        "out": str(tmp / "out.npz"),
        "generate": {"vocab": GENERATE_VOCAB, "weights": generate_weights, "prompt": str(tmp / "prompt.npy")},
    }
    (tmp / "job.json").write_text(json.dumps(job))
    (tmp / "run.py").write_text(SCRIPT)
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, str(tmp / "run.py"), str(tmp / "job.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.join(os.path.dirname(__file__), "..", ".."),
    )
    assert done.returncode == 0, done.stderr[-4000:]
    generate = {"lm": generate_lm, "prompt": prompt}
    return x, ids, layers, lm, dict(np.load(tmp / "out.npz")), generate


@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_layer_on_jax_matches_tensorflow(jax_run, name, causal):
    x, _, layers, _, out, _ = jax_run
    layer = layers[name]
    expected = np.asarray(layer(x, x, use_causal_mask=causal))
    got = out[f"{name}/{'causal' if causal else 'noncausal'}"]
    conditioning = layer_conditioning(layer, x, x, causal=causal, per_channel=True)
    # n: projections (DIM in, H*M out) + the map's projection (D) + keys (T) + features (C).
    n = DIM + HEADS * KEY_DIM + KEY_DIM + T + layer.feature_dim
    assert_close(got, expected, n=n, conditioning=conditioning, paths=2, what=name)


def test_causal_lm_on_jax_matches_tensorflow(jax_run):
    _, ids, _, lm, out, _ = jax_run
    expected = np.asarray(lm(ids))
    # n per block: 2 hidden (LN, q/k/v) + D + S + C + H*M + 2 hidden (LN, FFN in) + I; two blocks + final LN and logits.
    att = lm.decoder_blocks[0].attention
    block = 2 * 16 + att.key_dim + ids.shape[1] + att.feature_dim + 16 + 2 * 16 + 32
    n = 2 * block + 2 * 16
    assert_close(out["lm/logits"], expected, n=n, paths=2, what="parallel")
    assert_close(out["lm/steps"], expected, n=n, paths=2, what="steps on jax vs parallel on tensorflow")


def test_jax_backend_generates_tensorflows_tokens(jax_run):
    """JAX's `generate` (greedy and seeded top-k) gives TensorFlow's tokens from the same weights."""
    *_, out, generate = jax_run
    lm, prompt = generate["lm"], generate["prompt"]
    np.testing.assert_array_equal(out["generate/greedy"], lm.generate(prompt, max_length=14))
    np.testing.assert_array_equal(
        out["generate/top_k"],
        lm.generate(prompt, max_length=14, sampler=samplers.get("top_k", k=5, temperature=0.9), seed=11),
    )
