"""Routing policies: the policy file, filter tree, scorers, pickers and the Router."""
