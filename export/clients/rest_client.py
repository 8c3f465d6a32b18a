"""REST client for TF Serving: ``POST /v1/models/<name>:predict``.

Builds request bodies for the signatures written by `keras-linattn export`,
in TF Serving's row format (``"instances"``) or columnar format
(``"inputs"``), sends them with the standard library, and turns responses
back into numpy arrays.

    # encoder: random features of the exported shape
    python rest_client.py --model encoder --input features=x.npy
    # causal LM: greedy generation through the `generate` signature
    python rest_client.py --model lm --signature generate --prompt 1,2,3 --max-length 32
    # causal LM: sampling through `generate_sampled` (seeded: same seed, same tokens)
    python rest_client.py --model lm --signature generate_sampled --prompt 1,2,3 --max-length 32 \
        --temperature 0.8 --top-k 20 --top-p 0.95 --seed 7
    # print the JSON body instead of sending it
    python rest_client.py --model lm --prompt 1,2,3 --dry-run
"""

import argparse
import json
import sys
import urllib.request

import numpy as np


def predict_url(host, model, version=None):
    """``http://host/v1/models/<model>[/versions/<v>]:predict``."""
    if not host.startswith(("http://", "https://")):
        host = "http://" + host
    path = f"/v1/models/{model}" + (f"/versions/{int(version)}" if version is not None else "")
    return host.rstrip("/") + path + ":predict"


def predict_body(inputs, signature_name="serving_default", request_format="instances"):
    """A JSON-able ``:predict`` body for named numpy inputs.

    Args:
        inputs: dict of input name -> array.
        signature_name: the SavedModel signature to run.
        request_format: ``"instances"`` (one entry per example; every input
            needs the same batch size and no scalar inputs) or ``"inputs"``
            (columnar: each input as a whole, scalars allowed; needed for
            ``generate``'s ``max_length``).
    """
    arrays = {name: np.asarray(value) for name, value in inputs.items()}
    if request_format == "inputs":
        return {"signature_name": signature_name, "inputs": {k: v.tolist() for k, v in arrays.items()}}
    if request_format != "instances":
        raise ValueError(
            f"`request_format` must be 'instances' or 'inputs'. Received: request_format={request_format!r}"
        )
    sizes = {name: (v.shape[0] if v.ndim else None) for name, v in arrays.items()}
    if None in sizes.values() or len(set(sizes.values())) != 1:
        raise ValueError(
            "The 'instances' format needs every input to have the same batch dim and no scalar "
            f"input; use request_format='inputs'. Received: batch dims {sizes}"
        )
    if len(arrays) == 1:
        (value,) = arrays.values()
        return {"signature_name": signature_name, "instances": value.tolist()}
    batch = next(iter(sizes.values()))
    instances = [{name: v[i].tolist() for name, v in arrays.items()} for i in range(batch)]
    return {"signature_name": signature_name, "instances": instances}


def parse_response(body):
    """Numpy outputs from a ``:predict`` response (row or columnar)."""
    if "error" in body:
        raise RuntimeError(f"TF Serving error: {body['error']}")
    if "outputs" in body:
        outputs = body["outputs"]
        return (
            {k: np.asarray(v) for k, v in outputs.items()}
            if isinstance(outputs, dict)
            else {"output": np.asarray(outputs)}
        )
    predictions = body["predictions"]
    if predictions and isinstance(predictions[0], dict):
        return {k: np.asarray([p[k] for p in predictions]) for k in predictions[0]}
    return {"output": np.asarray(predictions)}


def predict(
    host, model, inputs, signature_name="serving_default", request_format="instances", version=None, timeout=60
):
    """Sends a ``:predict`` request; returns numpy outputs."""
    body = json.dumps(predict_body(inputs, signature_name, request_format)).encode()
    request = urllib.request.Request(
        predict_url(host, model, version), data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return parse_response(json.loads(response.read()))


def _parse_inputs(items):
    inputs = {}
    for item in items or []:
        name, _, path = item.partition("=")
        if not path:
            raise ValueError(f"--input must be NAME=FILE.npy. Received: {item!r}")
        inputs[name] = np.load(path)
    return inputs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="localhost:8501")
    parser.add_argument("--model", required=True, help="model name in models.config")
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--signature", default=None, help="default: serving_default, or generate with --prompt")
    parser.add_argument("--format", dest="request_format", choices=("instances", "inputs"), default=None)
    parser.add_argument("--input", action="append", help="NAME=FILE.npy (repeatable)")
    parser.add_argument("--prompt", default=None, help="comma-separated token ids (causal LMs)")
    parser.add_argument("--max-length", type=int, default=32)
    sampling = parser.add_argument_group("generate_sampled")
    sampling.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: all (default)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1: all (default)")
    sampling.add_argument("--seed", type=int, default=0, help="int64 seed of the draws (default 0)")
    parser.add_argument("--dry-run", action="store_true", help="print the request body and exit")
    args = parser.parse_args(argv)

    if args.prompt is not None:
        signature = args.signature or "generate"
        inputs = {"prompt_ids": np.array([[int(t) for t in args.prompt.split(",")]], np.int32)}
        if signature.startswith("generate"):
            inputs["padding_mask"] = np.ones_like(inputs["prompt_ids"])
            inputs["max_length"] = np.int32(args.max_length)
            if signature == "generate_sampled":
                inputs["temperature"] = np.float32(args.temperature)
                inputs["top_k"] = np.int32(args.top_k)
                inputs["top_p"] = np.float32(args.top_p)
                inputs["seed"] = np.int64(args.seed)
        else:
            inputs = {"token_ids": inputs["prompt_ids"]}
        request_format = args.request_format or "inputs"
    else:
        signature = args.signature or "serving_default"
        inputs = _parse_inputs(args.input)
        if not inputs:
            parser.error("give --input NAME=FILE.npy or --prompt")
        request_format = args.request_format or "instances"
    if args.dry_run:
        print(json.dumps(predict_body(inputs, signature, request_format)))
        return 0
    outputs = predict(args.host, args.model, inputs, signature, request_format, args.version)
    for name, value in outputs.items():
        print(f"{name}: shape={value.shape}")
        print(value if value.size <= 64 else value.reshape(-1)[:64])
    return 0


if __name__ == "__main__":
    sys.exit(main())
