"""The engines the gateway knows: endpoints and pools (``endpoint``, compiled), their health
checks (``health``) and the engine metric contract (``scrape``); the tenant buckets shared across replicas through
Redis (``statestore``)."""
