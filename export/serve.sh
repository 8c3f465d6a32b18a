#!/usr/bin/env bash
# Start TF Serving on the models under ./exported (see README.md).
#   ./serve.sh cpu        tensorflow/serving (CPU)
#   ./serve.sh gpu        tensorflow/serving:*-gpu (needs the NVIDIA container toolkit)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mode="${1:-cpu}"
image="tensorflow/serving:latest"
gpu_args=()
if [ "$mode" = "gpu" ]; then
  image="tensorflow/serving:latest-gpu"
  gpu_args=(--gpus all)
elif [ "$mode" != "cpu" ]; then
  echo "usage: $0 [cpu|gpu]" >&2
  exit 2
fi
exec docker run --rm "${gpu_args[@]}" \
  -p 8500:8500 -p 8501:8501 \
  -v "$here/exported:/models:ro" \
  -v "$here/models.config:/config/models.config:ro" \
  "$image" \
  --model_config_file=/config/models.config \
  --enable_model_warmup=true \
  --rest_api_port=8501 --port=8500
