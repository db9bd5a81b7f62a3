"""dockrl: RL post-training of LLMs over a distributed transfer dock."""

__version__ = "0.1.0"
