package k8s

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Decoded is one object read from a YAML or JSON file.
type Decoded struct {
	GVK schema.GroupVersionKind
	// Key of the object. For a skipped document it is read on a best-effort
	// basis from its metadata.
	Key Key
	// Object is the decoded object, or nil when GVK is not a registered kind:
	// such documents are skipped, not errors.
	Object Object
	// Line is the line in the file where the document (or List item) starts.
	Line int
}

// DecodeFile decodes the Kubernetes objects in one file: YAML documents
// separated by "---" (a leading "---" and empty documents are fine), or JSON,
// each an object with apiVersion and kind, or a "kind: List" of such objects
// in "items". name is only used in error messages, which have the form
// "name:line: problem".
//
// Documents are decoded through JSON into new objects of the Go type that
// kinds registers for their apiVersion and kind, so any type with json tags
// works without a runtime.Scheme. Namespaced objects without a namespace get
// "default"; cluster-scoped ones lose any namespace they were given.
//
// A document without apiVersion or kind, one that doesn't decode into its
// type, one without metadata.name, or an object defined twice in the file is
// an error. All errors of the file are returned joined, and no objects: a
// file is applied as a whole or not at all. It never panics, whatever data is.
func DecodeFile(name string, data []byte, kinds *Kinds) ([]Decoded, error) {
	return decodeFile(context.Background(), name, data, kinds)
}

// decodeFile is DecodeFile that gives up with ctx's error when ctx ends: a
// file of a few MB of small documents takes seconds to decode.
func decodeFile(ctx context.Context, name string, data []byte, kinds *Kinds) ([]Decoded, error) {
	var (
		out  []Decoded
		errs []error
	)
	// Documents are split on "---" lines first, as kubectl does, so that a
	// syntax error in one document doesn't hide the others and every error
	// gets at least the line where its document starts.
	for _, c := range splitDocuments(data) {
		dec := yaml.NewDecoder(bytes.NewReader(c.data))
		for {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			var doc yaml.Node
			if err := dec.Decode(&doc); err != nil {
				if !errors.Is(err, io.EOF) {
					// The parser can't resynchronise after a syntax error.
					errs = append(errs, yamlErr(name, c.line-1, c.line, err))
				}
				break
			}
			shiftLines(&doc, c.line-1)
			root := &doc
			if root.Kind == yaml.DocumentNode {
				if len(root.Content) == 0 {
					continue
				}
				root = root.Content[0]
			}
			if root.Kind == yaml.ScalarNode && root.ShortTag() == "!!null" {
				continue // an empty document, e.g. only comments
			}
			ds, err := decodeDocument(ctx, name, root, kinds)
			out = append(out, ds...)
			errs = append(errs, err)
		}
	}

	seen := map[objectID]int{}
	for _, d := range out {
		if d.Object == nil {
			continue
		}
		id := objectID{d.GVK, d.Key}
		if line, ok := seen[id]; ok {
			errs = append(errs, fmt.Errorf("%s:%d: %s %s is already defined at line %d",
				name, d.Line, d.GVK.Kind, d.Key, line))
			continue
		}
		seen[id] = d.Line
	}

	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return out, nil
}

// decodeDocument decodes one document: an object or a List of objects.
func decodeDocument(ctx context.Context, name string, n *yaml.Node, kinds *Kinds) ([]Decoded, error) {
	if n.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%s:%d: document is not a mapping", name, n.Line)
	}
	var v any
	if err := n.Decode(&v); err != nil {
		return nil, yamlErr(name, 0, n.Line, err)
	}
	m, ok := normalize(v).(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%s:%d: document is not a mapping", name, n.Line)
	}
	if m["kind"] != "List" {
		d, err := decodeObject(name, m, n, kinds)
		if err != nil {
			return nil, err
		}
		return []Decoded{d}, nil
	}

	// A List as "kubectl get -o yaml" writes it.
	items, ok := m["items"].([]any)
	if !ok && m["items"] != nil {
		return nil, fmt.Errorf("%s:%d: List items is not a sequence", name, lineOf(n, "items", n.Line))
	}
	itemNodes := mappingValue(n, "items")
	var (
		out  []Decoded
		errs []error
	)
	for i, item := range items {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		// Item nodes give line numbers; they line up with the decoded items
		// unless aliases or merges were involved, then the List's line does.
		itemNode := n
		if itemNodes != nil && itemNodes.Kind == yaml.SequenceNode && len(itemNodes.Content) == len(items) {
			itemNode = itemNodes.Content[i]
		}
		im, ok := item.(map[string]any)
		if !ok {
			errs = append(errs, fmt.Errorf("%s:%d: List item is not a mapping", name, itemNode.Line))
			continue
		}
		d, err := decodeObject(name, im, itemNode, kinds)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, d)
	}
	return out, errors.Join(errs...)
}

// decodeObject turns one object's generic form into a typed object. n is its
// node, for line numbers.
func decodeObject(name string, m map[string]any, n *yaml.Node, kinds *Kinds) (Decoded, error) {
	line := n.Line
	apiVersion, _ := m["apiVersion"].(string)
	kind, _ := m["kind"].(string)
	if apiVersion == "" || kind == "" {
		return Decoded{}, fmt.Errorf("%s:%d: document needs apiVersion and kind", name, line)
	}
	gv, err := schema.ParseGroupVersion(apiVersion)
	if err != nil {
		return Decoded{}, fmt.Errorf("%s:%d: %w", name, lineOf(n, "apiVersion", line), err)
	}
	gvk := gv.WithKind(kind)
	d := Decoded{GVK: gvk, Line: line, Key: keyFromMap(m)}
	desc, ok := kinds.lookup(gvk)
	if !ok {
		return d, nil
	}

	what := kind + " " + d.Key.String()
	if desc.namespaced && d.Key.Namespace == "" {
		what = kind + " default/" + d.Key.Name
	}
	js, err := json.Marshal(m)
	if err != nil {
		// E.g. a .nan value, which JSON can't represent.
		return Decoded{}, fmt.Errorf("%s:%d: %s: %w", name, line, what, err)
	}
	obj := desc.newObject()
	if err := json.Unmarshal(js, obj); err != nil {
		return Decoded{}, fmt.Errorf("%s:%d: %s: %w", name, jsonErrLine(n, err), what, err)
	}
	obj.GetObjectKind().SetGroupVersionKind(gvk)
	if obj.GetName() == "" {
		return Decoded{}, fmt.Errorf("%s:%d: %s has no metadata.name", name, lineOf(n, "metadata", line), kind)
	}
	switch {
	case desc.namespaced && obj.GetNamespace() == "":
		obj.SetNamespace("default")
	case !desc.namespaced:
		obj.SetNamespace("")
	}
	d.Object, d.Key = obj, KeyOf(obj)
	return d, nil
}

// normalize makes a value decoded by yaml JSON-compatible: mappings with
// non-string keys (yaml allows "1: x") become string-keyed maps.
func normalize(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			v[k] = normalize(e)
		}
		return v
	case map[any]any:
		out := make(map[string]any, len(v))
		for k, e := range v {
			out[fmt.Sprint(k)] = normalize(e)
		}
		return out
	case []any:
		for i, e := range v {
			v[i] = normalize(e)
		}
		return v
	}
	return v
}

func keyFromMap(m map[string]any) Key {
	meta, _ := m["metadata"].(map[string]any)
	ns, _ := meta["namespace"].(string)
	name, _ := meta["name"].(string)
	return Key{Namespace: ns, Name: name}
}

// mappingValue returns the value node of key in mapping n, or nil.
func mappingValue(n *yaml.Node, key string) *yaml.Node {
	if n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Kind == yaml.ScalarNode && n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}

// lineOf returns the line of key in mapping n, or def.
func lineOf(n *yaml.Node, key string, def int) int {
	if n.Kind != yaml.MappingNode {
		return def
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if k := n.Content[i]; k.Kind == yaml.ScalarNode && k.Value == key {
			return k.Line
		}
	}
	return def
}

// jsonErrLine finds the line of the value that encoding/json choked on, by
// following the error's field path ("spec.ports.port") through the node and
// picking the first value of the JSON type it complained about. It falls
// back to the document's line.
func jsonErrLine(n *yaml.Node, err error) int {
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) || te.Field == "" {
		return n.Line
	}
	if found := findPath(n, strings.Split(te.Field, "."), te.Value); found != nil {
		return found.Line
	}
	return n.Line
}

// findPath returns the first node at path below n whose JSON type is want
// ("string", "number", "bool", "array", "object"; anything else matches any
// node). Sequences are searched element by element, as the JSON path names no
// indexes. Aliases are not followed, which keeps the search linear.
func findPath(n *yaml.Node, path []string, want string) *yaml.Node {
	if len(path) == 0 {
		if jsonTypeMatches(n, want) {
			return n
		}
		return nil
	}
	switch n.Kind {
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			if n.Content[i].Value == path[0] {
				if found := findPath(n.Content[i+1], path[1:], want); found != nil {
					return found
				}
			}
		}
	case yaml.SequenceNode:
		for _, c := range n.Content {
			if found := findPath(c, path, want); found != nil {
				return found
			}
		}
	}
	return nil
}

func jsonTypeMatches(n *yaml.Node, want string) bool {
	switch want {
	case "string":
		return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!str"
	case "number":
		return n.Kind == yaml.ScalarNode && (n.ShortTag() == "!!int" || n.ShortTag() == "!!float")
	case "bool":
		return n.Kind == yaml.ScalarNode && n.ShortTag() == "!!bool"
	case "array":
		return n.Kind == yaml.SequenceNode
	case "object":
		return n.Kind == yaml.MappingNode
	}
	return true
}

// chunk is one "---"-separated part of a file; line is where it starts.
type chunk struct {
	line int
	data []byte
}

// splitDocuments splits data at lines that are just "---" (trailing blanks
// allowed), the document separator kubectl recognises.
func splitDocuments(data []byte) []chunk {
	var (
		out       []chunk
		start     int
		startLine = 1
		line      = 1
	)
	for off := 0; off < len(data); line++ {
		end, next := len(data), len(data)
		if i := bytes.IndexByte(data[off:], '\n'); i >= 0 {
			end, next = off+i, off+i+1
		}
		if l := data[off:end]; bytes.HasPrefix(l, []byte("---")) && len(bytes.TrimRight(l[3:], " \t\r")) == 0 {
			out = append(out, chunk{line: startLine, data: data[start:off]})
			start, startLine = next, line+1
		}
		off = next
	}
	return append(out, chunk{line: startLine, data: data[start:]})
}

// shiftLines makes the line numbers of a chunk's nodes lines of the file.
// Alias targets are part of the tree, so following Content visits every node
// once.
func shiftLines(n *yaml.Node, by int) {
	n.Line += by
	for _, c := range n.Content {
		shiftLines(c, by)
	}
}

var yamlLineRe = regexp.MustCompile(`^(?:yaml: )?line (\d+): (.*)$`)

// yamlParserProblems are the errors of yaml's parser (as opposed to its
// scanner), whose line numbers yaml reports counting from 0.
var yamlParserProblems = map[string]bool{
	"did not find expected ',' or ']'":       true,
	"did not find expected ',' or '}'":       true,
	"did not find expected '-' indicator":    true,
	"did not find expected <document start>": true,
	"did not find expected <stream-start>":   true,
	"did not find expected key":              true,
	"did not find expected node content":     true,
	"found duplicate %TAG directive":         true,
	"found duplicate %YAML directive":        true,
	"found incompatible YAML document":       true,
	"found undefined tag handle":             true,
}

// yamlErr rewrites a yaml error into "name:line: problem" lines. Lines in the
// error are shifted by offset; an error without a line gets line.
func yamlErr(name string, offset, line int, err error) error {
	format := func(msg string) string {
		if m := yamlLineRe.FindStringSubmatch(msg); m != nil {
			if n, err := strconv.Atoi(m[1]); err == nil {
				if yamlParserProblems[m[2]] {
					n++
				}
				return fmt.Sprintf("%s:%d: %s", name, n+offset, m[2])
			}
		}
		return fmt.Sprintf("%s:%d: %s", name, line, strings.TrimPrefix(msg, "yaml: "))
	}
	var te *yaml.TypeError
	if errors.As(err, &te) {
		lines := make([]string, len(te.Errors))
		for i, e := range te.Errors {
			lines[i] = format(e)
		}
		return errors.New(strings.Join(lines, "\n"))
	}
	return errors.New(format(err.Error()))
}
