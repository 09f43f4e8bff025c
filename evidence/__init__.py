"""Offline evidence pipeline: the scripts that make and measure the drafter (see evidence/README.md)."""
