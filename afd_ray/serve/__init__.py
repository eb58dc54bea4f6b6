"""The Serve application: the OpenAI ingress and the builder that binds the pools."""
