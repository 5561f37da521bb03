"""The engines the gateway knows: endpoints and pools (``endpoint``, compiled), their health
checks (``health``) and the engine metric contract (``scrape``). Where their counts live
across workers is velocity_fast/state/."""
