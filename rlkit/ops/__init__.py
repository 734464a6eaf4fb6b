"""The RL math as small pure functions over tensors and masks, each with its shapes in the docstring and
chosen by name from a registry: advantages, KL estimators, policy losses and their aggregation, GAE,
token log-probs, preference losses. No I/O, no models beyond a forward call.
"""
