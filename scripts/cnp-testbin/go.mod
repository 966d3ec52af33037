module cnptestbin

go 1.26.6

require sigs.k8s.io/network-policy-api v0.3.0
