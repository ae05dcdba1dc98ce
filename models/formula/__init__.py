"""Printed-formula recognition: the adapter, its preprocessing and static decoder."""
