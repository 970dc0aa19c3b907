"""Bundled weights of the byte-level models (``<name>.npz`` params and ``<name>.json`` records).

Data only: `paged.models.registry` reads the files from this folder. It is a package so that the
files install with ``paged`` as its package data.
"""
