package v1alpha1

import (
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// crd is the part of apiextensions.k8s.io/v1 CustomResourceDefinition the
// test checks (the apiextensions module is not a dependency).
type crd struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec struct {
		Group string `json:"group"`
		Scope string `json:"scope"`
		Names struct {
			Kind     string `json:"kind"`
			ListKind string `json:"listKind"`
			Plural   string `json:"plural"`
			Singular string `json:"singular"`
		} `json:"names"`
		Versions []struct {
			Name    string `json:"name"`
			Served  bool   `json:"served"`
			Storage bool   `json:"storage"`
			Schema  struct {
				OpenAPIV3Schema schemaProps `json:"openAPIV3Schema"`
			} `json:"schema"`
		} `json:"versions"`
	} `json:"spec"`
}

type schemaProps struct {
	Type       string                 `json:"type"`
	Required   []string               `json:"required"`
	Properties map[string]schemaProps `json:"properties"`
	Items      *schemaProps           `json:"items"`
}

// crdPath is the manifest of the Identity CRD, relative to this package.
const crdPath = "../../deploy/crds/identities.yaml"

// jsonFields returns the JSON names and kinds of the fields of t, inlined
// structs flattened.
func jsonFields(t reflect.Type) map[string]reflect.Kind {
	out := map[string]reflect.Kind{}
	for f := range t.Fields() {
		tag := f.Tag.Get("json")
		name, opts, _ := strings.Cut(tag, ",")
		if opts == "inline" {
			for k, v := range jsonFields(f.Type) {
				out[k] = v
			}
			continue
		}
		if name == "" || name == "-" || !f.IsExported() {
			continue
		}
		out[name] = f.Type.Kind()
	}
	return out
}

func TestCRDMatchesTypes(t *testing.T) {
	data, err := os.ReadFile(crdPath)
	if err != nil {
		t.Fatal(err)
	}
	var c crd
	if err := yaml.Unmarshal(data, &c); err != nil {
		t.Fatalf("parse %s: %v", crdPath, err)
	}
	if c.APIVersion != "apiextensions.k8s.io/v1" || c.Kind != "CustomResourceDefinition" {
		t.Fatalf("not a v1 CRD: %s %s", c.APIVersion, c.Kind)
	}
	if want := IdentityResource + "." + GroupVersion.Group; c.Metadata.Name != want {
		t.Errorf("metadata.name = %q, want %q", c.Metadata.Name, want)
	}
	s := c.Spec
	if s.Group != GroupVersion.Group {
		t.Errorf("group = %q, want %q", s.Group, GroupVersion.Group)
	}
	if want := map[bool]string{true: "Namespaced", false: "Cluster"}[IdentityKind.Namespaced]; s.Scope != want {
		t.Errorf("scope = %q, want %q", s.Scope, want)
	}
	if s.Names.Kind != IdentityKindName || s.Names.ListKind != IdentityListKind ||
		s.Names.Plural != IdentityResource || s.Names.Singular != IdentitySingular {
		t.Errorf("names = %+v, want %s/%s/%s/%s", s.Names, IdentityKindName, IdentityListKind, IdentityResource, IdentitySingular)
	}
	if IdentityKind.Resource != IdentityResource || IdentityKind.GVK != GroupVersion.WithKind(IdentityKindName) {
		t.Errorf("IdentityKind = %v %s disagrees with the constants", IdentityKind.GVK, IdentityKind.Resource)
	}
	if len(s.Versions) != 1 || s.Versions[0].Name != GroupVersion.Version || !s.Versions[0].Served || !s.Versions[0].Storage {
		t.Fatalf("versions = %+v, want one served storage version %s", s.Versions, GroupVersion.Version)
	}

	// Every JSON field of the Go type is in the schema with the matching
	// type, and the schema has nothing the type lacks.
	root := s.Versions[0].Schema.OpenAPIV3Schema
	fields := jsonFields(reflect.TypeFor[Identity]())
	kindTypes := map[reflect.Kind]string{reflect.String: "string", reflect.Slice: "array", reflect.Struct: "object"}
	for name, k := range fields {
		p, ok := root.Properties[name]
		if !ok {
			t.Errorf("field %q of Identity is not in the schema", name)
			continue
		}
		if p.Type != kindTypes[k] {
			t.Errorf("field %q: schema type %q, Go kind %s", name, p.Type, k)
		}
	}
	for name := range root.Properties {
		if _, ok := fields[name]; !ok {
			t.Errorf("schema property %q is not a field of Identity", name)
		}
	}
	if l := root.Properties["securityLabels"]; l.Items == nil || l.Items.Type != "string" {
		t.Errorf("securityLabels items = %+v, want strings", l.Items)
	}
	if !slices.Contains(root.Required, "securityLabels") {
		t.Errorf("securityLabels is not required: %v", root.Required)
	}
}
