"""Retrieval evaluation of the public memory routes (``ibex eval ...``), driven over HTTP like any client."""
