"""Sailfish's bottom layer: what every other package may use and that imports nothing of ours.

Layering: `common` <- `ngram` <- `index` <- `server` <- `bench`;
a package imports only those to its left.
"""
