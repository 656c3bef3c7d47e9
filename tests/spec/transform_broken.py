"""A transform module that fails when imported (tests/spec/test_transforms.py): validation
reports the failure at the transform's line instead of a traceback."""

raise RuntimeError("this module cannot be imported\nsecond line")
