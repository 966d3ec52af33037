package k8s

// InformerVerbs are the verbs the informer of a Kind uses on its resource
// (NewResource lists and watches, nothing else). deploy/'s RBAC is tested
// against them.
var InformerVerbs = []string{"list", "watch"}
