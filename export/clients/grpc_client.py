"""gRPC client for TF Serving: ``PredictionService.Predict`` on port 8500.

Builds `tensorflow_serving.apis.predict_pb2.PredictRequest`s for the
signatures written by `keras-linattn export` (needs `tensorflow-serving-api`
and `grpcio`, both dependencies of ``keras-linattn[serving]``).

    python grpc_client.py --model encoder --input features=x.npy
    python grpc_client.py --model lm --signature generate --prompt 1,2,3 --max-length 32
    # decode token by token through the `step` signature (state kept client-side)
    python grpc_client.py --model lm --signature step --prompt 1,2,3 --max-length 32 --describe exported/lm/1
"""

import argparse
import json
import os
import sys

import numpy as np
import tensorflow as tf


def predict_request(model, inputs, signature_name="serving_default", version=None):
    """A `PredictRequest` for named numpy inputs."""
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature_name
    if version is not None:
        request.model_spec.version.value = int(version)
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(np.asarray(value)))
    return request


def response_outputs(response):
    """Numpy outputs of a `PredictResponse`."""
    return {name: tf.make_ndarray(proto) for name, proto in response.outputs.items()}


def stub_for(target):
    import grpc
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 256 << 20)])
    return prediction_service_pb2_grpc.PredictionServiceStub(channel)


def predict(stub, request, timeout=60.0):
    return response_outputs(stub.Predict(request, timeout))


def zero_state(description, batch_size):
    """The LM's initial decoding state from the export's keras_linattn.json."""
    if "initial_state" in description:
        return [
            np.repeat(np.asarray(s, dtype=spec["dtype"]), batch_size, axis=0)
            for s, spec in zip(description["initial_state"], description["state"], strict=True)
        ]
    return [np.zeros([batch_size] + spec["shape"][1:], dtype=spec["dtype"]) for spec in description["state"]]


def greedy_with_step(call, description, prompt, max_length):
    """Greedy decoding with the ``step`` signature; `call(inputs)` runs one request."""
    prompt = np.asarray(prompt, np.int32)
    state = zero_state(description, prompt.shape[0])
    tokens = [prompt[:, t] for t in range(prompt.shape[1])]
    logits = None
    for t in range(max_length):
        if t >= prompt.shape[1]:
            tokens.append(np.argmax(logits, axis=-1).astype(np.int32))
        if t == max_length - 1:
            break
        feeds = {"token_t": tokens[t]}
        feeds.update({f"state_{i}": s for i, s in enumerate(state)})
        out = call(feeds)
        logits = out["logits"]
        state = [out[f"new_state_{i}"] for i in range(len(state))]
    return np.stack(tokens[:max_length], axis=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="localhost:8500")
    parser.add_argument("--model", required=True)
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--signature", default=None)
    parser.add_argument("--input", action="append", help="NAME=FILE.npy (repeatable)")
    parser.add_argument("--prompt", default=None, help="comma-separated token ids (causal LMs)")
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--describe", default=None, help="SavedModel version dir (for --signature step)")
    parser.add_argument("--dry-run", action="store_true", help="print the request and exit")
    args = parser.parse_args(argv)

    if args.prompt is not None:
        prompt = np.array([[int(t) for t in args.prompt.split(",")]], np.int32)
        signature = args.signature or "generate"
        if signature == "step":
            if args.describe is None:
                parser.error("--signature step needs --describe VERSION_DIR (for the state layout)")
            with open(os.path.join(args.describe, "assets.extra", "keras_linattn.json")) as f:
                description = json.load(f)
            stub = None if args.dry_run else stub_for(args.target)

            def call(feeds):
                request = predict_request(args.model, feeds, "step", args.version)
                if args.dry_run:
                    print(request)
                    raise SystemExit(0)
                return predict(stub, request)

            print(greedy_with_step(call, description, prompt, args.max_length))
            return 0
        inputs = {"prompt_ids": prompt, "padding_mask": np.ones_like(prompt), "max_length": np.int32(args.max_length)}
        if not signature.startswith("generate"):
            inputs = {"token_ids": prompt}
    else:
        signature = args.signature or "serving_default"
        inputs = {}
        for item in args.input or []:
            name, _, path = item.partition("=")
            inputs[name] = np.load(path)
        if not inputs:
            parser.error("give --input NAME=FILE.npy or --prompt")
    request = predict_request(args.model, inputs, signature, args.version)
    if args.dry_run:
        print(request)
        return 0
    for name, value in predict(stub_for(args.target), request).items():
        print(f"{name}: shape={value.shape}")
        print(value if value.size <= 64 else value.reshape(-1)[:64])
    return 0


if __name__ == "__main__":
    sys.exit(main())
