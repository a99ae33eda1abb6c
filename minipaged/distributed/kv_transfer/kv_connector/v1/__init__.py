"""vLLM V1's connector API and the connectors built on it."""
