"""wine_app: multinomial logistic regression in numpy on scikit-learn's wine data (a Flower App)."""
