"""IMDB sentiment classification with a linear-attention encoder (TFDS ``imdb_reviews``).

python -m examples.text_classification.train --help
"""
