"""IBEX Harness."""
