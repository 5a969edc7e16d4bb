"""digits_app: a Flower App training a numpy model on scikit-learn's 8x8 digits."""
