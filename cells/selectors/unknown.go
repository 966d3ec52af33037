package selectors

import (
	"encoding/json"
	"reflect"
	"slices"
	"strconv"
	"strings"
)

// UnmarshalJSON decodes the policy and notes the fields of its rules that
// apiary does not know: ignored (and logged at debug level) outside the
// rule lists, an error inside them.
func (p *CiliumNetworkPolicy) UnmarshalJSON(data []byte) error {
	type plain CiliumNetworkPolicy
	if err := json.Unmarshal(data, (*plain)(p)); err != nil {
		return err
	}
	p.unknown, p.unsupported = unknownRuleFields(data)
	return nil
}

// UnmarshalJSON decodes the policy and notes the fields of its rules that
// apiary does not know.
func (p *CiliumClusterwideNetworkPolicy) UnmarshalJSON(data []byte) error {
	type plain CiliumClusterwideNetworkPolicy
	if err := json.Unmarshal(data, (*plain)(p)); err != nil {
		return err
	}
	p.unknown, p.unsupported = unknownRuleFields(data)
	return nil
}

// UnknownFields returns the paths of the fields of the policy's rules that
// apiary ignores, e.g. "spec.description" or "spec.nodeSelector".
func (p *CiliumNetworkPolicy) UnknownFields() []string { return p.unknown }

// UnknownFields returns the paths of the fields of the policy's rules that
// apiary ignores.
func (p *CiliumClusterwideNetworkPolicy) UnknownFields() []string { return p.unknown }

// UnsupportedFields returns the paths of the fields inside the policy's
// ingress, ingressDeny, egress and egressDeny rules that apiary does not
// implement, e.g. "spec.egress[0].toPorts[0].rules": each makes the
// policy invalid, since enforcing the rule without it would allow or deny
// something else than what it says.
func (p *CiliumNetworkPolicy) UnsupportedFields() []string { return p.unsupported }

// UnsupportedFields returns the paths of the fields inside the policy's
// rules that apiary does not implement.
func (p *CiliumClusterwideNetworkPolicy) UnsupportedFields() []string { return p.unsupported }

// unknownRuleFields lists the fields under spec and specs that Rule has no
// field for: ignored ones, and unsupported ones (below a field tagged
// apiary:"strict", with a value that is not empty).
func unknownRuleFields(data []byte) (ignored, unsupported []string) {
	var doc struct {
		Spec  any   `json:"spec"`
		Specs []any `json:"specs"`
	}
	if json.Unmarshal(data, &doc) != nil {
		return nil, nil
	}
	w := &unknownWalker{}
	rule := reflect.TypeFor[Rule]()
	if doc.Spec != nil {
		w.walk(doc.Spec, rule, "spec", false)
	}
	for i, s := range doc.Specs {
		w.walk(s, rule, "specs["+strconv.Itoa(i)+"]", false)
	}
	slices.Sort(w.ignored)
	slices.Sort(w.unsupported)
	return w.ignored, w.unsupported
}

type unknownWalker struct {
	ignored, unsupported []string
}

// walk notes the paths in v (decoded JSON) that t, a struct, slice or map
// type with json tags, has no place for. strict says that v is inside a
// rule list, where an unknown field is unsupported unless it is empty.
func (w *unknownWalker) walk(v any, t reflect.Type, path string, strict bool) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct:
		obj, ok := v.(map[string]any)
		if !ok {
			return
		}
		type field struct {
			t      reflect.Type
			strict bool
		}
		fields := map[string]field{}
		for f := range t.Fields() {
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "" || name == "-" || !f.IsExported() {
				continue
			}
			fields[name] = field{f.Type, f.Tag.Get("apiary") == "strict"}
		}
		for k, sub := range obj {
			f, ok := fields[k]
			switch {
			case ok:
				w.walk(sub, f.t, path+"."+k, strict || f.strict)
			case strict && !emptyJSON(sub):
				w.unsupported = append(w.unsupported, path+"."+k)
			default:
				w.ignored = append(w.ignored, path+"."+k)
			}
		}
	case reflect.Slice:
		list, ok := v.([]any)
		if !ok {
			return
		}
		for i, sub := range list {
			w.walk(sub, t.Elem(), path+"["+strconv.Itoa(i)+"]", strict)
		}
	}
}

// emptyJSON reports whether v (decoded JSON) says nothing: null, "", [] or
// {}. Such a field asks for nothing apiary lacks (tools emit `icmps: []`).
func emptyJSON(v any) bool {
	switch v := v.(type) {
	case nil:
		return true
	case string:
		return v == ""
	case []any:
		return len(v) == 0
	case map[string]any:
		return len(v) == 0
	}
	return false
}
