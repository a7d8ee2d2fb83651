"""The kopf operator: RLJob -> pods, services, configmaps, podgroups, networkpolicies; status from observed pods."""
