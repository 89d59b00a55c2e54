"""The scikit-learn layer: the estimators, their preprocessing and tabicl's reference arguments. Imports serving and the network."""
