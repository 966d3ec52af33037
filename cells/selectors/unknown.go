package selectors

import (
	"encoding/json"
	"reflect"
	"slices"
	"strings"
)

// UnmarshalJSON decodes the policy and notes the fields of its rules that
// apiary does not know, which are ignored (and logged at debug level).
func (p *CiliumNetworkPolicy) UnmarshalJSON(data []byte) error {
	type plain CiliumNetworkPolicy
	if err := json.Unmarshal(data, (*plain)(p)); err != nil {
		return err
	}
	p.unknown = unknownRuleFields(data)
	return nil
}

// UnmarshalJSON decodes the policy and notes the fields of its rules that
// apiary does not know.
func (p *CiliumClusterwideNetworkPolicy) UnmarshalJSON(data []byte) error {
	type plain CiliumClusterwideNetworkPolicy
	if err := json.Unmarshal(data, (*plain)(p)); err != nil {
		return err
	}
	p.unknown = unknownRuleFields(data)
	return nil
}

// UnknownFields returns the paths of the fields in the policy's rules that
// apiary ignores, e.g. "spec.egress[0].toPorts".
func (p *CiliumNetworkPolicy) UnknownFields() []string { return p.unknown }

// UnknownFields returns the paths of the fields in the policy's rules that
// apiary ignores.
func (p *CiliumClusterwideNetworkPolicy) UnknownFields() []string { return p.unknown }

// unknownRuleFields lists the fields under spec and specs that Rule has no
// field for.
func unknownRuleFields(data []byte) []string {
	var doc struct {
		Spec  any   `json:"spec"`
		Specs []any `json:"specs"`
	}
	if json.Unmarshal(data, &doc) != nil {
		return nil
	}
	var out []string
	rule := reflect.TypeFor[Rule]()
	if doc.Spec != nil {
		out = walkUnknown(doc.Spec, rule, "spec", out)
	}
	for i, s := range doc.Specs {
		out = walkUnknown(s, rule, "specs["+itoa(i)+"]", out)
	}
	slices.Sort(out)
	return out
}

func itoa(i int) string {
	b, _ := json.Marshal(i)
	return string(b)
}

// walkUnknown appends to out the paths in v (decoded JSON) that t, a
// struct, slice or map type with json tags, has no place for.
func walkUnknown(v any, t reflect.Type, path string, out []string) []string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Struct:
		obj, ok := v.(map[string]any)
		if !ok {
			return out
		}
		fields := map[string]reflect.Type{}
		for f := range t.Fields() {
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "" || name == "-" || !f.IsExported() {
				continue
			}
			fields[name] = f.Type
		}
		for k, sub := range obj {
			ft, ok := fields[k]
			if !ok {
				out = append(out, path+"."+k)
				continue
			}
			out = walkUnknown(sub, ft, path+"."+k, out)
		}
	case reflect.Slice:
		list, ok := v.([]any)
		if !ok {
			return out
		}
		for i, sub := range list {
			out = walkUnknown(sub, t.Elem(), path+"["+itoa(i)+"]", out)
		}
	}
	return out
}
