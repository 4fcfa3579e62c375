"""rldynamics: an RL trainer for language-model agents with training-dynamics diagnostics built in.

Importing the package is cheap: torch, transformers, matplotlib and optional trackers are imported
only by the modules that use them.
"""

__version__ = "0.1.0"
