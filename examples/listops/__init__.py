"""Long Range Arena ListOps: a local TFDS builder, a tokenizer and a training script.

python -m examples.listops.train --help
"""
