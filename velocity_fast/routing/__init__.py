"""Where each request runs: pools, endpoint state and health, profiles, affinity."""
