"""Errors that say whose input is at fault, shared by the processes that must tell a client so."""


class BadInput(ValueError):
    """A client's input a policy cannot take (an observation it cannot score, a history it cannot read).

    The actor answers that job alone with `bad_request`; every other error of a job is `internal`.
    """
