# One version train for all six distributions; bump together (see README "Versions").
__version__ = "0.2.0"
# Bumped when this package's public names (its __init__ exports) change incompatibly.
INTERFACE_VERSION = 2
