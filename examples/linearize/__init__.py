"""Linearize a pretrained keras-hub GPT-2 or Llama into linear attention (LoLCATs), end to end.

python -m examples.linearize.run --help
"""
