"""Runs SavedModel signatures the way TF Serving does (TF1 loader + Session)."""

import numpy as np
import tensorflow as tf

from keras_linattn import _compat
from keras_linattn.export import saved_model

__all__ = ["SavedModelRunner"]


class SavedModelRunner:
    """Executes the signatures of a SavedModel through a TF1 `Session`.

    This is the path of `tensorflow_model_server` and `saved_model_cli run`:
    the MetaGraph tagged ``serve`` is loaded into a graph, and each
    signature is run by feeding and fetching the tensor names recorded in
    its `SignatureDef`. What passes here is what the server executes.

    Args:
        export_dir: a SavedModel directory (one version, e.g.
            ``base_dir/1``).
        tags: MetaGraph tags; default ``["serve"]``.

    Call arguments (`run`):
        signature_name: e.g. ``"serving_default"`` or ``"step"``.
        inputs: dict of name -> array-like, one entry per signature input.

    Returns:
        dict of output name -> numpy array.

    Example:

    >>> import os, tempfile
    >>> import keras
    >>> from keras_linattn import export, layers
    >>> keras.utils.set_random_seed(0)
    >>> inputs = keras.Input((None, 16), name="features")
    >>> model = keras.Model(inputs, layers.LinearAttention(2, 8, name="head")(inputs, inputs))
    >>> version_dir = export.export_saved_model(model, os.path.join(tempfile.mkdtemp(), "encoder"))
    >>> runner = SavedModelRunner(version_dir)
    >>> x = np.random.default_rng(0).normal(size=(2, 7, 16)).astype("float32")  # [B, T, width]
    >>> y = runner.run("serving_default", {"features": x})["head"]
    >>> y.shape, bool(np.allclose(y, model.predict(x, verbose=0), atol=1e-5))
    ((2, 7, 16), True)
    """

    def __init__(self, export_dir, tags=None):
        self.export_dir = export_dir
        self.tags = list(tags or [tf.saved_model.SERVING])
        self._graph = tf.Graph()
        self._session = tf.compat.v1.Session(graph=self._graph)
        try:
            # The TF1 loader is deliberate (it is the path TF Serving and
            # saved_model_cli load through); its deprecation notice is not for users.
            with self._graph.as_default(), _compat.silence_tf_deprecation():
                meta = tf.compat.v1.saved_model.loader.load(self._session, self.tags, export_dir)
        except (OSError, RuntimeError, ValueError, tf.errors.OpError) as e:
            # Missing dir / saved_model.pb, corrupt protobuf, damaged variables, unknown tags.
            self._session.close()
            raise ValueError(
                "`export_dir` is not a loadable SavedModel version directory "
                f"({_load_failure(export_dir, e)}). Received: export_dir={export_dir!r}, tags={self.tags}"
            ) from e
        self.signature_defs = {k: v for k, v in meta.signature_def.items() if not k.startswith("__")}

    @property
    def signature_names(self):
        return sorted(self.signature_defs)

    def input_info(self, signature_name):
        """{input name: (numpy dtype, shape with -1 for dynamic dims)}."""
        sig = self._signature(signature_name)
        return {
            name: (
                tf.dtypes.as_dtype(info.dtype).as_numpy_dtype,
                [d.size for d in info.tensor_shape.dim],
            )
            for name, info in sig.inputs.items()
        }

    def _signature(self, signature_name):
        if signature_name not in self.signature_defs:
            raise ValueError(
                f"Unknown signature. Received: signature_name={signature_name!r}. Available: {self.signature_names}"
            )
        return self.signature_defs[signature_name]

    def run(self, signature_name, inputs):
        sig = self._signature(signature_name)
        missing = sorted(set(sig.inputs) - set(inputs))
        extra = sorted(set(inputs) - set(sig.inputs))
        if missing or extra:
            raise ValueError(
                f"Signature {signature_name!r} takes inputs {sorted(sig.inputs)}. "
                f"Received: missing={missing}, unexpected={extra}"
            )
        feed = {}
        for name, info in sig.inputs.items():
            dtype = tf.dtypes.as_dtype(info.dtype).as_numpy_dtype
            feed[info.name] = np.asarray(inputs[name]).astype(dtype, copy=False)
        fetches = {name: info.name for name, info in sig.outputs.items()}
        return self._session.run(fetches, feed_dict=feed)

    def close(self):
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _load_failure(export_dir, error):
    """Why a SavedModel did not load: the error's first informative line, and the damaged file.

    The TF loader reports damaged variables as "Graph execution error:" with
    the reason on a later line and no file name; the digests recorded at
    export (`check_integrity`) name the file.
    """
    message = getattr(error, "message", None) or str(error)
    lines = [line.strip() for line in message.splitlines()]
    lines = [line for line in lines if line and line != "Graph execution error:" and not line.startswith("[[")]
    reason = lines[0] if lines else type(error).__name__
    try:
        saved_model.check_integrity(export_dir)
    except ValueError as damaged:
        return f"{reason}; {damaged}"
    return reason
