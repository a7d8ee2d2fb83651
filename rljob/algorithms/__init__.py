"""Advantages, policy losses and KL estimators: pure torch functions."""
