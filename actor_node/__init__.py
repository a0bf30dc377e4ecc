"""Actor node: scores candidate actions with the policy and answers the broker."""
