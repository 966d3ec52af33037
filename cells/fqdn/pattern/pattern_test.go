package pattern

import (
	"strings"
	"testing"

	"github.com/miekg/dns"
)

func TestMatch(t *testing.T) {
	tests := []struct {
		pattern string
		isName  bool
		match   []string
		noMatch []string
	}{
		{"www.cilium.io", true, []string{"www.cilium.io", "WWW.Cilium.IO.", "www.cilium.io."}, []string{"cilium.io", "a.www.cilium.io", "wwwxcilium.io"}},
		{"*.cilium.io", false, []string{"www.cilium.io", "dev.cilium.io.", "x_y-1.cilium.io"}, []string{"cilium.io", "a.b.cilium.io", "www.cilium.org"}},
		{"*cilium.io", false, []string{"cilium.io", "subcilium.io"}, []string{"sub.cilium.io"}},
		{"sub*.cilium.io", false, []string{"sub.cilium.io", "subdomain.cilium.io"}, []string{"su.cilium.io", "a.sub.cilium.io"}},
		{"a*b*c.io", false, []string{"abc.io", "aXbYc.io", "abbbc.io", "acbc.io"}, []string{"ab.io", "abcd.io"}},
		{"**.cilium.io", false, []string{"app.cilium.io", "test.app.cilium.io"}, []string{"cilium.io", "app.cilium.org"}},
		{"***.cilium.io", false, []string{"a.b.c.cilium.io"}, []string{"cilium.io"}},
		{"www.**.io", false, []string{"www.cilium.io"}, []string{"www.a.b.io"}},
		{"*", false, []string{"cilium.io", "a.b.c.d", ".", ""}, nil},
		{"**", false, []string{"cilium.io", "x"}, nil},
		{"*.", false, []string{"cilium.io"}, nil},
		{"*.*", false, []string{"cilium.io"}, []string{"a.b.c", "io"}},
		{"Example.COM.", true, []string{"example.com"}, nil},
	}
	for _, tt := range tests {
		var (
			p   *Pattern
			err error
		)
		if tt.isName {
			p, err = ParseName(tt.pattern)
		} else {
			p, err = ParsePattern(tt.pattern)
		}
		if err != nil {
			t.Fatalf("%q: %s", tt.pattern, err)
		}
		for _, n := range tt.match {
			if !p.Match(n) {
				t.Errorf("%q does not match %q, want match", tt.pattern, n)
			}
		}
		for _, n := range tt.noMatch {
			if p.Match(n) {
				t.Errorf("%q matches %q, want no match", tt.pattern, n)
			}
		}
	}
}

// TestMatchEscapedDots checks names whose labels hold a literal dot, as
// miekg/dns presents them ("x\.ok.com." is the labels "x.ok" and "com"):
// such a label is one label, never two, and no star matches its escape.
func TestMatchEscapedDots(t *testing.T) {
	// The presentation form comes from a real query's wire bytes.
	wire := []byte{0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 4, 'x', '.', 'o', 'k', 3, 'c', 'o', 'm', 0, 0, 1, 0, 1}
	var m dns.Msg
	if err := m.Unpack(wire); err != nil {
		t.Fatal(err)
	}
	if got := m.Question[0].Name; got != `x\.ok.com.` {
		t.Fatalf("miekg/dns presents the name as %q, want %q", got, `x\.ok.com.`)
	}
	tests := []struct {
		pattern string
		match   []string
		noMatch []string
	}{
		{"**.ok.com", []string{`a\.b.ok.com.`, "x.ok.com."}, []string{`x\.ok.com.`, `x\.ok.com`, `X\.OK.com.`, `a.x\.ok.com.`}},
		{"*.ok.com", []string{"x.ok.com"}, []string{`x\.ok.com.`, `a\.b.ok.com.`, `a\046b.ok.com.`}},
		{"*.com", []string{"ok.com"}, []string{`x\.ok.com.`, `x\\.com.`}},
		{"*ok.com", []string{"xok.com"}, []string{`x\.ok.com.`}},
		{"**.com", []string{`x\.ok.com.`, `a\\.b.com.`}, []string{`com\.`, "com"}},
		{"ok.com", nil, []string{`ok\.com.`, `ok\.com`, `ok.com\.`}},
		{"ok", nil, []string{`ok\.`, `ok\..`}},
	}
	for _, tt := range tests {
		p, err := ParsePattern(tt.pattern)
		if err != nil {
			t.Fatalf("%q: %s", tt.pattern, err)
		}
		for _, n := range tt.match {
			if !p.Match(n) {
				t.Errorf("%q does not match %q, want match", tt.pattern, n)
			}
		}
		for _, n := range tt.noMatch {
			if p.Match(n) {
				t.Errorf("%q matches %q, want no match", tt.pattern, n)
			}
		}
	}
	for in, want := range map[string]string{`ok\.`: `ok\.`, `ok\\.`: `ok\\`, `ok\..`: `ok\.`, `X\.Ok.com.`: `x\.ok.com`} {
		if got := Normalize(in); got != want {
			t.Errorf("Normalize(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestString(t *testing.T) {
	for in, want := range map[string]string{
		"*.Example.com.":  "*.example.com",
		" www.cilium.io ": "www.cilium.io",
		"**.cilium.io":    "**.cilium.io",
		"*.":              "*",
	} {
		p, err := ParsePattern(in)
		if err != nil {
			t.Fatalf("%q: %s", in, err)
		}
		if p.String() != want {
			t.Errorf("%q: String() = %q, want %q", in, p.String(), want)
		}
	}
}

func TestInvalid(t *testing.T) {
	tests := []struct {
		s      string
		isName bool
		want   string
	}{
		{"", false, "empty"},
		{".", true, "empty"},
		{"*.a.com", true, "not allowed"},
		{"a b.com", false, "not allowed"},
		{"a..com", false, "empty label"},
		{".a.com", true, "empty label"},
		{"é.com", false, "not allowed"},
		{strings.Repeat("a", 256), true, "longer than"},
	}
	for _, tt := range tests {
		var err error
		if tt.isName {
			_, err = ParseName(tt.s)
		} else {
			_, err = ParsePattern(tt.s)
		}
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want one containing %q", tt.s, err, tt.want)
		}
	}
}

// FuzzMatch checks that parsing and matching never panic and that a
// parsed name always matches itself.
func FuzzMatch(f *testing.F) {
	f.Add("*.cilium.io", "www.cilium.io")
	f.Add("**.a", "b.c.a")
	f.Add("a*b*c*d", "axxbxxcxxd")
	f.Fuzz(func(t *testing.T, pat, name string) {
		if p, err := ParsePattern(pat); err == nil {
			p.Match(name)
		}
		if p, err := ParseName(name); err == nil && !p.Match(name) {
			t.Errorf("name %q does not match itself", name)
		}
	})
}
