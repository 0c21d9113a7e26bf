"""Tools an agent's model may call: the interface (``base.py``), the runner that bounds every call
(``runner.py``), and the built-ins -- a calculator, a lookup over a local corpus, a Python sandbox."""
