"""The ``keras-linattn`` command line: its arguments, its output, its errors.

    keras-linattn export model.keras --out exported --name encoder
    keras-linattn verify exported

The console script enters here, not in `keras_linattn.cli` (the commands):
this module needs only the standard library until the arguments are parsed
and the paths checked. ``keras-linattn --help``, a bad argument and a missing
MODEL, ``--out`` file or DIR answer at once; TensorFlow is loaded only to run
a command.

Backend: both commands run Keras on TensorFlow (export traces `tf.function`s).
Under ``KERAS_BACKEND=jax`` (or torch) the variable is replaced before Keras
loads; where Keras already runs another backend (`main` called from a JAX
session), the command runs again in a subprocess with
``KERAS_BACKEND=tensorflow``.

Output: without ``--verbose`` TensorFlow's native log lines (oneDNN and CUDA
notices, ``failed call to cuInit`` on machines without a GPU, ignored Assert
ops) are kept out by `keras_linattn.quiet`: ``TF_CPP_MIN_LOG_LEVEL=3`` is set
before TensorFlow loads, and what TensorFlow writes to stderr while it loads
(lines printed before its logging is set up, which no variable turns off) is
held back, and shown only if the import fails. Every error is one line, ``error: <what and the fix>``,
with exit status 2 (``--verbose`` adds the traceback); see
`keras_linattn.cli` for the exit status of ``verify``.
"""

import argparse
import os
import re
import subprocess
import sys
import traceback

__all__ = ["build_parser", "check_paths", "main"]

FORMATS = ("saved_model", "onnx")
_ERROR_STATUS = 2


class CommandError(Exception):
    """An error whose message is the whole line to print: what went wrong and the fix."""


def _parse_formats(text):
    formats = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise argparse.ArgumentTypeError(
            f"--format must be a comma-separated subset of {','.join(FORMATS)}. Received: {text!r}"
        )
    return formats


# Entries of an export directory that are not model names: a model by one of these names would share them.
RESERVED_NAMES = ("keras", "onnx", "manifest.json")


def check_name(name, option="--name"):
    """`name` if it is one plain path component that names a model in an export directory.

    A model's files go to ``<out>/<name>/``, ``<out>/onnx/<name>.onnx`` and
    ``<out>/keras/<name>.keras``: a separator or ``..`` would put them
    outside ``--out`` (``../x``) or in nested folders (``a/b``).

    Raises:
        ValueError: naming the option and the value received.
    """
    problem = None
    if not name:
        problem = "is empty"
    elif any(c in name for c in "/\\\0") or (os.altsep and os.altsep in name):
        problem = "holds a path separator or NUL"
    elif name in (".", "..") or name.startswith("."):
        problem = "starts with '.' (the current or parent directory, or a hidden or staging entry)"
    elif name in RESERVED_NAMES:
        problem = f"is one of the export directory's own entries {RESERVED_NAMES}"
    if problem:
        raise ValueError(
            f"{option} must be one plain name, a single path component inside --out: it {problem}. "
            f"Received: {option}={name!r}"
        )
    return name


def _parse_name(text):
    try:
        return check_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_opset(text):
    try:
        opset = int(text)
    except ValueError:
        opset = None
    if opset is None or opset < 1:
        raise argparse.ArgumentTypeError(f"--opset must be a positive integer (an ONNX opset). Received: {text!r}")
    return opset


def _parse_shapes(text):
    shapes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if not match:
            raise argparse.ArgumentTypeError(f"--shapes must look like 1x7,3x13 (batch x length). Received: {text!r}")
        shapes.append((int(match.group(1)), int(match.group(2))))
    return shapes


def build_parser():
    """The argument parser of ``keras-linattn`` (the standard library only)."""
    # --verbose before or after the command; the subcommands' default must not overwrite the top level's.
    verbosity = argparse.ArgumentParser(add_help=False)
    verbosity.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show TensorFlow's log lines, every check as it runs and the traceback of an error",
    )
    parser = argparse.ArgumentParser(
        prog="keras-linattn",
        description="Export keras_linattn models to SavedModel (TF Serving) and ONNX, and verify the exports.",
        parents=[verbosity],
    )
    parser.set_defaults(verbose=False)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "export", help="export a .keras model to SavedModel (TF Serving) and/or ONNX", parents=[verbosity]
    )
    p.add_argument("model", metavar="MODEL.keras", help="a model saved with model.save('....keras')")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--format", type=_parse_formats, default=list(FORMATS), help="saved_model,onnx (default both)")
    p.add_argument(
        "--name",
        type=_parse_name,
        default=None,
        help="model name (TF Serving; one path component); default: the file's stem",
    )
    p.add_argument("--version", type=int, default=None, help="SavedModel version; default: next free")
    p.add_argument("--opset", type=_parse_opset, default=17, help="ONNX opset (default 17)")
    p.add_argument("--no-warmup", action="store_true", help="do not write TF Serving warmup requests")
    p.add_argument(
        "--no-generate", action="store_true", help="causal LMs: skip generate signatures and the ONNX step graph"
    )

    v = sub.add_parser(
        "verify", help="compare an export directory's artifacts with its Keras model", parents=[verbosity]
    )
    v.add_argument("dir", metavar="DIR", help="directory written by `keras-linattn export`")
    v.add_argument(
        "--name", type=_parse_name, default=None, help="verify only this model (default: every model in DIR)"
    )
    v.add_argument(
        "--shapes",
        type=_parse_shapes,
        default=None,
        help="batch x length list (default 1x7,3x13,2x70, lengths clipped to the model's max_sequence_length, "
        "plus one of that full length)",
    )
    v.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="tokens compared for step/generate (default: max_sequence_length, else 5)",
    )
    v.add_argument(
        "--saved-model-tolerance",
        type=float,
        default=None,
        help="fixed max relative difference (default: the error model, eps * sqrt(n) * conditioning)",
    )
    v.add_argument("--onnx-tolerance", type=float, default=None, help="likewise for onnxruntime")
    v.add_argument("--device", default="cpu", choices=("cpu", "auto", "gpu"), help="onnxruntime device (default cpu)")
    v.add_argument("-q", "--quiet", action="store_true", help="no line per check while the checks run (the table only)")
    return parser


def check_paths(args):
    """The paths the command reads or writes exist where they must: before TensorFlow loads (seconds).

    Raises:
        CommandError: naming the argument and the path received.
    """
    if args.command == "export":
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise CommandError(f"--out must be a directory. Received: --out={args.out!r} (a file)")
        if not os.path.isfile(args.model):
            what = "a directory" if os.path.isdir(args.model) else "no such file"
            raise CommandError(f"MODEL must be an existing .keras file ({what}). Received: MODEL={args.model!r}")
    elif args.command == "verify" and not os.path.isfile(os.path.join(args.dir, "manifest.json")):
        raise CommandError(
            f"DIR must be a directory written by `keras-linattn export` (no manifest.json). Received: DIR={args.dir!r}"
        )


def log(message="", stream=None):
    """One line to stdout (or `stream`), flushed: progress shows while a long step runs."""
    print(message, file=stream or sys.stdout, flush=True)


def _tensorflow_backend(argv):
    """Keras on TensorFlow for the commands (export traces `tf.function`s), whatever KERAS_BACKEND says.

    Returns None when Keras will run on TensorFlow in this process; else
    (Keras already imported on another backend: `main` called from a JAX
    session) the exit status of the command run again in a subprocess
    with ``KERAS_BACKEND=tensorflow``.
    """
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend == "tensorflow":
        return None
    keras = sys.modules.get("keras")
    if keras is None or not hasattr(keras, "backend"):  # Keras not imported yet: it reads the variable on import
        os.environ["KERAS_BACKEND"] = "tensorflow"
        return None
    if keras.backend.backend() == "tensorflow":
        return None
    env = dict(os.environ, KERAS_BACKEND="tensorflow")
    args = list(sys.argv[1:] if argv is None else argv)
    return subprocess.run([sys.executable, "-m", "keras_linattn_cli", *args], env=env, check=False).returncode


def _load_commands(verbose):
    """`keras_linattn.cli`, with TensorFlow's start-up lines kept out of the output unless `verbose`."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if "tensorflow" in sys.modules:  # loaded already (a Python session calling `main`): its logging is its own
        from keras_linattn import cli

        return cli
    if verbose:
        from keras_linattn import cli

        return cli
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"  # read when TensorFlow's native library loads: set it first
    from keras_linattn import quiet  # the package's import is light: TensorFlow loads in `quiet`

    quiet()  # TensorFlow imported with its start-up lines held back; its Python loggers at ERROR
    from keras_linattn import cli

    return cli


def _one_line(error):
    """`error` as one line that names what to do."""
    message = " ".join(str(error).split())
    if isinstance(error, CommandError):
        return message
    if isinstance(error, ImportError):
        module = getattr(error, "name", None)
        missing = f"the Python module {module!r} is missing" if module else f"an import failed ({message})"
        return (
            f"{missing}: install keras-linattn with its dependencies (pip install keras-linattn, or pip install -e . "
            "in a checkout); --verbose shows the traceback"
        )
    if isinstance(error, (ValueError, OSError)):  # bad input, a damaged or missing file: the message says which
        return message or type(error).__name__
    return f"{type(error).__name__}: {message or 'no message'} (an unexpected error; --verbose shows the traceback)"


def main(argv=None):
    """Runs ``keras-linattn`` with `argv` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)  # --help and bad arguments end here (exit status 0 / 2)
    try:
        check_paths(args)  # a mistyped path answers at once, not after TensorFlow's start
        status = _tensorflow_backend(argv)
        if status is not None:
            return status
        cli = _load_commands(args.verbose)
        return cli.run(args)
    except KeyboardInterrupt:
        log("error: interrupted", stream=sys.stderr)
        return 130
    except Exception as e:  # every error: one line with the fix, no traceback unless --verbose
        if args.verbose:
            traceback.print_exc()
        log(f"error: {_one_line(e)}", stream=sys.stderr)
        return _ERROR_STATUS


if __name__ == "__main__":
    sys.exit(main())
