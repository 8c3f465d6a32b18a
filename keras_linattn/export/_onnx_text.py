"""Text in and out of the exported ONNX graphs: the tokenizer written beside them, read back without TensorFlow.

`export_onnx` of a causal LM with a preprocessor writes its tokenizer into
``<model>_tokenizer/`` beside the step graph: ``tokenizer.json`` (the kind,
the special ids, the preprocessor's settings and the keras-hub config) and
keras-hub's own assets (``vocabulary.json`` + ``merges.txt`` for byte-pair
tokenizers, ``vocabulary.spm`` for SentencePiece). `OnnxGenerator.generate`
then takes strings and returns strings, tokenizing with the ``tokenizers``
package (byte-pair), ``sentencepiece`` or plain Python (byte and code point
tokenizers): numpy and onnxruntime plus that one package, no TensorFlow.
"""

import json
import os
import shutil
import tempfile

import numpy as np

__all__ = []

CONFIG_FILE = "tokenizer.json"
_KINDS = ("byte_pair", "sentence_piece", "byte", "unicode_codepoint")


def tokenizer_dir_name(model, path):
    """``<model stem>_tokenizer`` when `model` has a preprocessor with a tokenizer, else None."""
    tokenizer = getattr(getattr(model, "preprocessor", None), "tokenizer", None)
    if tokenizer is None:
        return None
    return os.path.splitext(os.path.basename(os.fspath(path)))[0] + "_tokenizer"


def _kind(tokenizer):
    import keras_hub

    for kind, cls in (
        ("byte_pair", keras_hub.tokenizers.BytePairTokenizer),
        ("sentence_piece", keras_hub.tokenizers.SentencePieceTokenizer),
        ("byte", keras_hub.tokenizers.ByteTokenizer),
        ("unicode_codepoint", keras_hub.tokenizers.UnicodeCodepointTokenizer),
    ):
        if isinstance(tokenizer, cls):
            return kind
    return None


def write_tokenizer(model, directory):
    """Writes `model`'s tokenizer (its preprocessor's) into `directory`, replacing what was there.

    Args:
        model: a causal LM whose ``preprocessor.tokenizer`` is a keras-hub tokenizer.
        directory: the ``<model>_tokenizer`` folder beside the step graph.
    """
    import keras

    preprocessor = model.preprocessor
    tokenizer = preprocessor.tokenizer
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tmp-tokenizer-", dir=parent)
    try:
        if hasattr(tokenizer, "save_assets"):
            tokenizer.save_assets(staging)
        config = {
            "kind": _kind(tokenizer),
            "class_name": type(tokenizer).__name__,
            "start_token_id": getattr(tokenizer, "start_token_id", None),
            "end_token_id": getattr(tokenizer, "end_token_id", None),
            "pad_token_id": getattr(tokenizer, "pad_token_id", None),
            "add_start_token": bool(getattr(preprocessor, "add_start_token", False)),
            "add_prefix_space": bool(getattr(tokenizer, "add_prefix_space", False)),
            "unsplittable_tokens": list(getattr(tokenizer, "unsplittable_tokens", None) or []),
            "keras_config": keras.saving.serialize_keras_object(tokenizer),
        }
        with open(os.path.join(staging, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, default=str)
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_step_graph(path, metadata):
    """A ValueError naming the step graph to pass when `path` is the model or the generate graph.

    Args:
        path: the file given to `OnnxGenerator`.
        metadata: its keras_linattn metadata (`_onnx_files.read_metadata`).

    Raises:
        ValueError: for a graph of an export whose step graph is another file.
    """
    graph = metadata.get("graph")
    if graph in (None, "step"):
        return
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    step = metadata.get("step_file")
    if step:
        hint = f"pass its step graph: OnnxGenerator({os.path.join(directory, *step.split('/'))!r})"
    else:
        stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
        hint = f"pass the step graph written beside it (``<model>_step.onnx``, e.g. {stem.rsplit('_', 1)[0]}_step.onnx)"
    raise ValueError(f"Not a step graph: this file is the {graph!r} graph; {hint}. Received: path={path!r}")


def is_text(prompts):
    """True for a string or a list / tuple / 1-D array of strings."""
    if isinstance(prompts, (str, bytes)):
        return True
    if isinstance(prompts, (list, tuple)) and prompts:
        return all(isinstance(p, (str, bytes)) for p in prompts)
    return isinstance(prompts, np.ndarray) and prompts.dtype.kind in "US" and prompts.ndim == 1


class TextCodec:
    """The exported tokenizer, without TensorFlow: strings -> left-padded ids, and ids -> strings.

    Args:
        directory: the ``<model>_tokenizer`` folder written by `write_tokenizer`.

    Raises:
        ValueError: for a tokenizer kind with no reader here, or a missing package (named).
    """

    def __init__(self, directory):
        with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as f:
            self.config = config = json.load(f)
        self.kind = config.get("kind")
        if self.kind not in _KINDS:
            raise ValueError(
                f"The exported tokenizer ({config.get('class_name')}) has no reader without TensorFlow (byte-pair, "
                f"SentencePiece, byte and code point tokenizers do): pass token ids. Received: directory={directory!r}"
            )
        self._tokenizer = None
        if self.kind == "byte_pair":
            self._tokenizer = _byte_pair(directory, config)
        elif self.kind == "sentence_piece":
            self._tokenizer = _sentence_piece(directory)

    def encode(self, text):
        """One list of token ids for `text` (no special tokens)."""
        if self.kind == "byte_pair":
            return list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        if self.kind == "sentence_piece":
            return list(self._tokenizer.encode(text))
        if self.kind == "byte":
            return list(text.encode("utf-8"))
        return [ord(c) for c in text]

    def decode(self, ids):
        """The text of a list of token ids."""
        ids = [int(i) for i in ids]
        if self.kind == "byte_pair":
            return self._tokenizer.decode(ids, skip_special_tokens=False)
        if self.kind == "sentence_piece":
            return self._tokenizer.decode(ids)
        if self.kind == "byte":
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")
        return "".join(chr(i) for i in ids)

    def prompts(self, texts):
        """``(token_ids [B, P] int32, padding_mask [B, P] bool)``: the start token first, left-padded.

        Raises:
            ValueError: for a prompt with no token.
        """
        start = self.config.get("start_token_id")
        head = [start] if self.config.get("add_start_token") and start is not None else []
        rows = [head + self.encode(t.decode("utf-8") if isinstance(t, bytes) else str(t)) for t in texts]
        if any(not row for row in rows):
            raise ValueError(f"Every prompt needs at least one token. Received: prompts={list(texts)!r}")
        width = max(len(row) for row in rows)
        ids = np.full((len(rows), width), self.config.get("pad_token_id") or 0, np.int32)
        mask = np.zeros((len(rows), width), bool)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = row
            mask[i, width - len(row) :] = True
        return ids, mask

    def texts(self, tokens, mask):
        """The text of each row: prompt and generated tokens up to the first end token, special tokens dropped."""
        end = self.config.get("end_token_id")
        special = {self.config.get("start_token_id"), end} - {None}
        prompt_length = mask.shape[1]
        out = []
        for row, row_mask in zip(np.asarray(tokens), mask, strict=True):
            generated = list(row[prompt_length:])
            if end is not None and end in generated:
                generated = generated[: generated.index(end)]
            ids = [int(t) for t in row[:prompt_length][row_mask]] + [int(t) for t in generated]
            out.append(self.decode([t for t in ids if t not in special]))
        return out


# keras-hub's `SPLIT_PATTERN_TOKENIZERS` (keras_hub/src/tokenizers/byte_pair_tokenizer.py), Llama 3's split.
_SPLIT_PATTERN = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)


def _byte_pair(directory, config):
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError as e:
        raise ValueError(
            "Text prompts of a byte-pair tokenizer need the `tokenizers` package (pip install tokenizers), "
            f"or pass token ids. Received: directory={directory!r}"
        ) from e
    with open(os.path.join(directory, "vocabulary.json"), encoding="utf-8") as f:
        vocabulary = json.load(f)
    with open(os.path.join(directory, "merges.txt"), encoding="utf-8") as f:
        merges = [tuple(line.split(" ")) for line in f.read().splitlines() if line and not line.startswith("#version")]
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=merges))
    if config.get("unsplittable_tokens"):
        tokenizer.add_special_tokens(list(config["unsplittable_tokens"]))
    # The set-up of keras-hub's own TensorFlow-free path (`BytePairTokenizer` with the `tokenizers` package):
    # the same ids as its TensorFlow path, except for runs of several spaces, which the two split differently.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=_SPLIT_PATTERN, behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")), use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentence_piece(directory):
    try:
        import sentencepiece
    except ImportError as e:
        raise ValueError(
            "Text prompts of a SentencePiece tokenizer need the `sentencepiece` package (pip install "
            f"sentencepiece), or pass token ids. Received: directory={directory!r}"
        ) from e
    with open(os.path.join(directory, "vocabulary.spm"), "rb") as f:
        return sentencepiece.SentencePieceProcessor(model_proto=f.read())


def generate_text(generator, prompts, max_length, **options):
    """`OnnxGenerator.generate` for text: through the exported tokenizer, the generate graph, and back.

    Args:
        generator: the `OnnxGenerator`.
        prompts: a string or a list of strings.
        max_length: total length in tokens, prompt included (None: the
            model's ``max_sequence_length``).
        **options: `generate`'s other arguments (`sampler`, `seed`, ...).

    Returns:
        A string for a string, else a list of strings.

    Raises:
        ValueError: when the export carries no tokenizer (naming the step file), or for a `padding_mask` with text.
    """
    step_path = generator.predictor.path
    name = generator.metadata.get("tokenizer")
    directory = os.path.join(os.path.dirname(os.path.abspath(step_path)), name) if name else None
    if directory is None or not os.path.isfile(os.path.join(directory, CONFIG_FILE)):
        raise ValueError(
            "Text prompts need the tokenizer written beside the step graph (``<model>_tokenizer/``, exported "
            "from a model with a preprocessor); this export has none: pass token ids. "
            f"Received: step_path={step_path!r}, tokenizer={directory!r}"
        )
    if options.get("padding_mask") is not None:
        raise ValueError("Text prompts are padded by the tokenizer: pass no `padding_mask`. Received: a padding_mask")
    options.pop("padding_mask", None)
    codec = generator.__dict__.get("_text_codec")
    if codec is None:
        codec = generator.__dict__["_text_codec"] = TextCodec(directory)
    single = isinstance(prompts, (str, bytes))
    ids, mask = codec.prompts([prompts] if single else list(prompts))
    if max_length is None:
        max_length = generator.metadata.get("max_sequence_length")
    tokens = generator.generate(ids, max_length, padding_mask=mask, **options)
    out = codec.texts(tokens, mask)
    return out[0] if single else out
