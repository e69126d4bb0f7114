"""moelora inside other libraries' models: see moelora.integrations.transformers."""
