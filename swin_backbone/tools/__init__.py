"""Command-line tools that ship with the installed package (``python -m swin_backbone.tools.<name>``).

The scripts under the repository's ``tools/`` are thin wrappers over these modules.
"""
