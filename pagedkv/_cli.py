"""The help format shared by the command-line tools (python -m pagedkv.demo / pagedkv.demo.simulate); their flags
are checked by pagedkv.validation."""
import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's line breaks and shows each default (unless it is None: those
    options say in their help what happens when they are not given)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)
