"""Character-level causal language model with `keras_linattn.models.LinearCausalLM`.

python -m examples.char_lm.train --help
"""
