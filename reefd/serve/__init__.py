"""Serve: a request's scenario and binding, the provider-neutral chat turn and admission in front of each engine."""
