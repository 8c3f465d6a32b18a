import gc
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.tolerance import rel_err  # noqa: E402,F401  (re-exported: tests import it from here)

# One seed for every test that draws numbers: Keras (and through it TensorFlow),
# NumPy's global generator and Python's `random`. Override it to replay a run
# or to sweep seeds: KLA_TEST_SEED=7 pytest ...
TEST_SEED = int(os.environ.get("KLA_TEST_SEED", "1234"))

# Hypothesis: under CI, a fixed derandomized profile so that a failure replays
# exactly; locally the default (random) profile keeps exploring.
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Plain asserts in the shared helpers report their operands like those in tests.
pytest.register_assert_rewrite("tests._helpers")

# The oracles compute in float64 (docs/dev/testing.md). JAX without 64-bit mode
# silently computes float64 in float32 (a cast to "float64" gives float32):
# under `KERAS_BACKEND=jax` (`make test-jax`) the suite turns it on, before any
# array exists, and checks that it took.
if keras.backend.backend() == "jax":
    import jax

    jax.config.update("jax_enable_x64", True)
    assert keras.ops.cast(1.0, "float64").dtype == "float64", "JAX's 64-bit mode did not take"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_finish(session):
    """Freezes the objects that exist once every test module is imported (TensorFlow, Keras, the package).

    Each test starts with `keras.utils.clear_session()`, whose garbage collection
    walked those ~400k long-lived objects every time, a cost paid by every test
    (docs/dev/testing.md). Frozen objects are never collected (they live for the
    whole run anyway); everything a test creates is still collected.
    """
    gc.collect()
    gc.freeze()


SLOW_CASES_FILE = os.path.join(os.path.dirname(__file__), "slow_cases.txt")


def read_slow_cases(path=SLOW_CASES_FILE):
    """The node ids listed in tests/slow_cases.txt (comments and blank lines dropped)."""
    with open(path, encoding="utf-8") as f:
        return [line.split("#", 1)[0].strip() for line in f if line.split("#", 1)[0].strip()]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the cases of tests/slow_cases.txt `slow`; skips `slow` tests without --runslow, and `tf_only`
    tests on a backend other than TensorFlow.

    ``@pytest.mark.tf_only("reason")`` marks a test of something only
    TensorFlow has (a SavedModel, `tf.data`...): under `KERAS_BACKEND=jax` it
    is skipped with ``tf_only: reason``, which `-rs` prints. The reason is
    required: a bare marker is an error, not a silent skip.
    """
    slow_cases = set(read_slow_cases())
    for item in items:
        if item.nodeid in slow_cases:  # before `-m` selects: `-m slow` picks these up
            item.add_marker(pytest.mark.slow)
    runslow = config.getoption("--runslow")
    slow = pytest.mark.skip(reason="slow: run `make test-slow` (pytest --runslow)")
    backend = keras.backend.backend()
    for item in items:
        if "slow" in item.keywords and not runslow:
            item.add_marker(slow)
        marker = item.get_closest_marker("tf_only")
        if marker is None:
            continue
        if len(marker.args) != 1 or not isinstance(marker.args[0], str) or not marker.args[0].strip():
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.tf_only needs one reason string")
        if backend != "tensorflow":
            item.add_marker(pytest.mark.skip(reason=f"tf_only on {backend}: {marker.args[0]}"))


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Every test starts with float32 policy, a fresh Keras session and seeded generators.

    The seed is set after `clear_session` (which forgets Keras' global seed).
    `keras.utils.set_random_seed` seeds Keras, TensorFlow, NumPy and `random`.
    """
    keras.config.set_dtype_policy("float32")
    keras.utils.clear_session(free_memory=False)  # gc once per module (below), not per test
    keras.utils.set_random_seed(TEST_SEED)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture(scope="module", autouse=True)
def _collect_garbage_per_module():
    """One full garbage collection after each test module.

    `clear_session()`'s own collection, run before every test, walked every object
    the run had created so far, so each test cost more than the one before it
    (docs/dev/testing.md). Python's generational collector still runs as usual in between.

    Before collecting, it forgets the gradients that `tf.custom_gradient` registered
    while the module traced graphs (`_forget_custom_gradients`): without that, every
    graph ever traced stays alive for the rest of the run.
    """
    registered = _custom_gradients()
    yield
    _forget_custom_gradients(registered)
    gc.collect()


def _gradient_registry():
    """TensorFlow's registry of gradient functions (a dict by op type), or None on another backend."""
    if keras.backend.backend() != "tensorflow":
        return None
    from tensorflow.python.framework import ops as tf_ops

    return getattr(getattr(tf_ops, "gradient_registry", None), "_registry", None)


def _custom_gradients():
    registry = _gradient_registry()
    return set() if registry is None else {name for name in registry if name.startswith("CustomGradient-")}


def _forget_custom_gradients(keep):
    """Removes the ``CustomGradient-<uid>`` entries registered since `keep` was listed.

    In graph mode (tracing a `tf.function`, an export, a Keras train step),
    `tf.custom_gradient` (`keras.ops.custom_gradient`, used by the elu map and the
    attention core's row division) registers the gradient under a fresh name in
    TensorFlow's global registry, and never removes it. The registered closure
    holds the traced tensors, hence the whole `FuncGraph` and everything it
    references: ~60k objects per SavedModel export of the smallest LM, kept to the
    end of the run and walked by every full garbage collection after it. A graph's
    custom gradients are looked up while its gradient is traced: within the module
    that traced it (no test differentiates a graph traced by another module).
    """
    registry = _gradient_registry()
    if registry is None:
        return
    for name in [name for name in registry if name.startswith("CustomGradient-") and name not in keep]:
        del registry[name]


@pytest.fixture(scope="session", autouse=True)
def _shared_exports_base(tmp_path_factory):
    """Tells tests/_shared_exports.py the folder that every pytest-xdist worker of this run shares.

    Under xdist each worker's basetemp is ``<run folder>/popen-gwN``: the parent is
    common to the run (pytest-xdist's documented pattern for session data built once).
    Only records the folder: nothing is built until a test asks for it.
    """
    from tests import _shared_exports

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    _shared_exports.BASE = base
    yield
    _shared_exports.BASE = None


@pytest.fixture
def rng():
    return np.random.default_rng(TEST_SEED)
