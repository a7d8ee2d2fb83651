"""The kopf operator: RLJob -> pods, services, configmaps, podgroups; status from observed pods."""
