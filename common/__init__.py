"""Pieces every PPOZ process shares: the wire protocol, configuration, Redis."""
