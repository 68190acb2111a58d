"""Safety: unlearning private facts with a PrivUn-style attack audit (`corpus`, `memorise`,
`unlearn`, `attacks`, `audit`), and sandbagging elicitation on a password-locked model
(`sandbag`, `elicit`). Everything runs on the built-in tiny model."""
